"""Write new keys and values into the paged KV cache at the slots of the slot mapping."""

from __future__ import annotations

import torch

from kvforge.kernels.kv_quant import (
    CODE_DTYPES,
    CODE_MAX,
    FP8_UNIT,
    check_triton_code_dtype,
    quantize_kv,
    quantize_rows,
)
from kvforge.kernels.triton_compat import jit, next_power_of_2, require_triton, tl
from kvforge.kernels.tuning import kernel_tuning
from kvforge.kernels.validation import FLOAT_DTYPES, INDEX_DTYPES, check_kv_scales, check_same_device, check_tensor
from kvforge.platforms import Platform, current_platform


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> None:
    """key/value: [num_tokens, num_kv_heads, head_dim];
    key_cache/value_cache: [num_blocks, block_size, num_kv_heads, head_dim];
    slot_mapping: [num_tokens] int, slot = block_id * block_size + offset (negative: skip);
    key_scale/value_scale: [num_blocks, block_size, num_kv_heads] float32 with a quantized (int8 or fp8)
    cache, which then receives codes (kv_quant.quantize_kv), else None.

    Writes in place; the caches may be strided views (e.g. the K and V halves of one tensor)."""
    slots = slot_mapping.long()
    if slots.numel() > 0 and int(slots.min()) < 0:  # padding tokens: nothing to write
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    for new, cache in _cache_rows(key, value, key_cache, value_cache, key_scale, value_scale):
        _write_slots(cache, slots, new)


def reshape_and_cache_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> None:
    """reshape_and_cache_ref through the C++ row copy (needs cpu_kernels()): no host sync, so it traces into
    a compiled step; negative slots (padding tokens) are skipped by the kernel."""
    slots = slot_mapping.long()
    for new, cache in _cache_rows(key, value, key_cache, value_cache, key_scale, value_scale):
        torch.ops.kvforge_cpu.cache_write(new.contiguous(), cache, slots)


def _cache_rows(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    key_scale: torch.Tensor | None, value_scale: torch.Tensor | None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """(rows in the cache's dtype, cache tensor) for every tensor a write fills: keys and values, or their
    codes and scales for a quantized cache."""
    if key_scale is None or value_scale is None:
        return [(key.to(key_cache.dtype), key_cache), (value.to(value_cache.dtype), value_cache)]
    rows = []
    for new, cache, scale in ((key, key_cache, key_scale), (value, value_cache, value_scale)):
        codes, scales = quantize_kv(new, cache.dtype)
        rows += [(codes, cache), (scales, scale)]
    return rows


def _write_slots(cache: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    if cache.dtype in CODE_DTYPES and cache.is_floating_point():  # NOTE: no index_copy_ for fp8 on the CPU
        cache, new = cache.view(torch.uint8), new.view(torch.uint8)
    num_blocks, block_size = cache.shape[:2]
    if cache.stride(0) == block_size * cache.stride(1):  # block and slot dims merge: one flat index
        cache.view(num_blocks * block_size, *cache.shape[2:]).index_copy_(0, slots, new)
    else:  # e.g. the K half of a [num_blocks, 2, block_size, ...] tensor
        cache[slots // block_size, slots % block_size] = new


@jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, key_scale_ptr, value_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_sb, stride_ss,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, QUANTIZED: tl.constexpr, CODE_MAX: tl.constexpr, ROUND: tl.constexpr,
    FP8_UNIT: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask, other=0.0)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask, other=0.0)
    k_dst = key_cache_ptr + block * stride_kcb + offset * stride_kcs + heads * stride_kch + dims
    v_dst = value_cache_ptr + block * stride_vcb + offset * stride_vcs + heads * stride_vch + dims
    if QUANTIZED:  # codes into the cache, one scale per head beside them (the scale tensors share strides)
        k, k_scale = quantize_rows(k, CODE_MAX, ROUND, FP8_UNIT)
        v, v_scale = quantize_rows(v, CODE_MAX, ROUND, FP8_UNIT)
        scale_offsets = block * stride_sb + offset * stride_ss + tl.arange(0, BLOCK_H)
        head_mask = tl.arange(0, BLOCK_H) < NUM_KV_HEADS
        tl.store(key_scale_ptr + scale_offsets, k_scale, mask=head_mask)
        tl.store(value_scale_ptr + scale_offsets, v_scale, mask=head_mask)
    tl.store(k_dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    *,
    platform: Platform | None = None,
) -> None:
    """reshape_and_cache_ref in Triton: one program per token, slot offsets in int64; a quantized cache
    gets each head's codes and scale from the same program. platform: whose tuning table and fp8 (None: the
    current platform's)."""
    require_triton()
    quantized = check_kv_scales(key_cache, key_scale, value_scale)
    check_triton_code_dtype(key_cache.dtype, platform if platform is not None else current_platform())
    num_kv_heads, head_dim = key_cache.shape[2:]
    check_tensor("value_cache", value_cache, shape=tuple(key_cache.shape), dtypes=(key_cache.dtype,))
    check_tensor("key", key, shape=(None, num_kv_heads, head_dim), dtypes=FLOAT_DTYPES)
    num_tokens = key.shape[0]
    check_tensor("value", value, shape=(num_tokens, num_kv_heads, head_dim), dtypes=FLOAT_DTYPES)
    check_tensor("slot_mapping", slot_mapping, shape=(num_tokens,), dtypes=INDEX_DTYPES)
    check_same_device(
        key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping,
        **({"key_scale": key_scale, "value_scale": value_scale} if quantized else {}),
    )
    if num_tokens == 0:
        return
    # NOTE: without scales the cache itself stands in for the scale pointers, which are never touched.
    key_scale = key_scale if quantized else key_cache
    value_scale = value_scale if quantized else value_cache
    block_h, block_d = next_power_of_2(num_kv_heads), next_power_of_2(head_dim)
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping, key_scale, value_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        key_scale.stride(0), key_scale.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        PAGE_SIZE=key_cache.shape[1], QUANTIZED=quantized, CODE_MAX=CODE_MAX.get(key_cache.dtype, 1.0),
        ROUND=key_cache.dtype == torch.int8, FP8_UNIT=FP8_UNIT.get(key_cache.dtype, 1.0),
        num_warps=kernel_tuning(platform).rows.num_warps(block_h * block_d),
    )  # fmt: skip
