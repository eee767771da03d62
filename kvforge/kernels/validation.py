"""Checks that launchers run before handing tensors to a Triton kernel: a bad tensor is a ValueError
that names it, not a wrong answer or an illegal memory access."""

from __future__ import annotations

import torch

from kvforge.kernels.kv_quant import CODE_DTYPES, SCALE_DTYPE

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(
    name: str,
    tensor: torch.Tensor,
    *,
    shape: tuple[int | None, ...],
    dtypes: tuple[torch.dtype, ...],
    unit_last_stride: bool = True,
) -> None:
    """shape: the expected sizes, None where any size goes; unit_last_stride: the last dim is contiguous."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != len(shape) or any(
        want is not None and got != want for got, want in zip(tensor.shape, shape, strict=True)
    ):
        wanted = tuple("*" if s is None else s for s in shape)
        raise ValueError(f"{name} must have shape {wanted}, got {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        raise ValueError(f"{name} must have a dtype in {dtypes}, got {tensor.dtype}")
    if unit_last_stride and tensor.numel() > 0 and tensor.stride(-1) != 1 and tensor.shape[-1] != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {tensor.stride()}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must be on one device, got {devices}")


def check_same_dtype(**tensors: torch.Tensor) -> None:
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        raise ValueError(f"tensors must share one dtype, got {dtypes}")


def check_matches(
    name: str,
    tensor: torch.Tensor,
    *,
    shape: torch.Size,
    dtype: torch.dtype,
    device: torch.device,
    contiguous: bool = False,
) -> None:
    """tensor (e.g. a caller-provided output buffer) must have exactly this shape, dtype and device."""
    if tensor.shape != shape or tensor.dtype != dtype or tensor.device != device:
        raise ValueError(
            f"{name} must be {tuple(shape)} {dtype} on {device}, "
            f"got {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}"
        )
    if contiguous and not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()}")


def check_kv_scales(
    key_cache: torch.Tensor, key_scale: torch.Tensor | None, value_scale: torch.Tensor | None
) -> bool:
    """Whether the cache is quantized: codes with [num_blocks, block_size, num_kv_heads] float32 scales
    (the key and value scales share strides), or model-dtype values without scales."""
    if key_scale is None and value_scale is None:
        check_tensor("key_cache", key_cache, shape=(None, None, None, None), dtypes=FLOAT_DTYPES)
        return False
    if key_scale is None or value_scale is None:
        raise ValueError("key_scale and value_scale go together: give both (quantized cache) or neither")
    check_tensor("key_cache", key_cache, shape=(None, None, None, None), dtypes=CODE_DTYPES)
    check_tensor("key_scale", key_scale, shape=tuple(key_cache.shape[:3]), dtypes=(SCALE_DTYPE,))
    check_tensor("value_scale", value_scale, shape=tuple(key_cache.shape[:3]), dtypes=(SCALE_DTYPE,))
    if key_scale.stride() != value_scale.stride():
        raise ValueError(
            f"key_scale and value_scale must share strides, got {key_scale.stride()} and {value_scale.stride()}"
        )
    return True
