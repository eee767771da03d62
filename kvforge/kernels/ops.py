"""The ops the model calls: `from kvforge.kernels import ops; ops.rms_norm(...)`.

Each name resolves to one implementation, picked once per process from the platform (Triton on CUDA
and ROCm, the torch reference on the CPU) and switchable with `set_backend("torch" | "triton")`.

The Triton launchers are registered as `torch.library` custom ops (`torch.ops.kvforge.*`) with fake
implementations, so torch.compile traces them as opaque nodes and CUDA graphs capture them. The
torch backend binds the references directly: they are plain torch code that compile traces through,
and a custom op in front of them only adds dispatch time on the CPU hot path (measured: 25-100 us per
call on a 2-core CPU, against 50-130 us for the rms_norm reference itself).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvforge.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from kvforge.kernels.cache_write import reshape_and_cache_ref, reshape_and_cache_triton
from kvforge.kernels.fused_moe import fused_moe_cpu, fused_moe_triton
from kvforge.kernels.int8_gemm import int8_gemm_ref, int8_gemm_triton
from kvforge.kernels.mla_decode import mla_decode_ref, mla_decode_triton
from kvforge.kernels.paged_attention import paged_attention_triton
from kvforge.kernels.paged_attention_cpu import paged_attention_cpu
from kvforge.kernels.quant_gemm import quant_gemm_ref, quant_gemm_triton
from kvforge.kernels.rms_norm import (
    fused_add_rms_norm_ref,
    fused_add_rms_norm_triton,
    rms_norm_ref,
    rms_norm_triton,
)
from kvforge.kernels.rotary import rotary_embedding_ref, rotary_embedding_triton
from kvforge.platforms import select_backend

Tensor = torch.Tensor


@torch.library.custom_op("kvforge::rms_norm", mutates_args=())
def _rms_norm_op(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return rms_norm_triton(x, weight, eps)


@_rms_norm_op.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


@torch.library.custom_op("kvforge::fused_add_rms_norm", mutates_args=())
def _fused_add_rms_norm_op(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return fused_add_rms_norm_triton(x, residual, weight, eps)


@_fused_add_rms_norm_op.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)), x.new_empty(x.shape)


@torch.library.custom_op("kvforge::rotary_embedding", mutates_args=())
def _rotary_embedding_op(
    positions: Tensor, query: Tensor, key: Tensor, cos_sin_cache: Tensor, is_neox: bool
) -> tuple[Tensor, Tensor]:
    return rotary_embedding_triton(positions, query, key, cos_sin_cache, is_neox)


@_rotary_embedding_op.register_fake
def _(
    positions: Tensor, query: Tensor, key: Tensor, cos_sin_cache: Tensor, is_neox: bool
) -> tuple[Tensor, Tensor]:
    return query.new_empty(query.shape), key.new_empty(key.shape)


@torch.library.custom_op("kvforge::silu_and_mul", mutates_args=())
def _silu_and_mul_op(x: Tensor) -> Tensor:
    return silu_and_mul_triton(x)


@_silu_and_mul_op.register_fake
def _(x: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@torch.library.custom_op(
    "kvforge::reshape_and_cache", mutates_args=("key_cache", "value_cache", "key_scale", "value_scale")
)
def _reshape_and_cache_op(
    key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor,
    key_scale: Tensor | None = None, value_scale: Tensor | None = None,
) -> None:  # fmt: skip
    reshape_and_cache_triton(key, value, key_cache, value_cache, slot_mapping, key_scale, value_scale)


@_reshape_and_cache_op.register_fake
def _(
    key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor,
    key_scale: Tensor | None = None, value_scale: Tensor | None = None,
) -> None:  # fmt: skip
    return None


@torch.library.custom_op("kvforge::paged_attention", mutates_args=())
def _paged_attention_op(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    scale: float,
    key_scale: Tensor | None = None,
    value_scale: Tensor | None = None,
) -> Tensor:
    return paged_attention_triton(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, key_scale, value_scale
    )


@_paged_attention_op.register_fake
def _(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    scale: float,
    key_scale: Tensor | None = None,
    value_scale: Tensor | None = None,
) -> Tensor:
    return query.new_empty(query.shape)


@torch.library.custom_op("kvforge::quant_gemm", mutates_args=())
def _quant_gemm_op(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor, bits: int) -> Tensor:
    return quant_gemm_triton(x, qweight, scales, zeros, bits)


@_quant_gemm_op.register_fake
def _(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor, bits: int) -> Tensor:
    return x.new_empty((x.shape[0], qweight.shape[0]))


@torch.library.custom_op("kvforge::int8_gemm", mutates_args=())
def _int8_gemm_op(a: Tensor, b: Tensor, a_scales: Tensor, b_scales: Tensor, out_dtype: torch.dtype) -> Tensor:
    return int8_gemm_triton(a, b, a_scales, b_scales, out_dtype)


@_int8_gemm_op.register_fake
def _(a: Tensor, b: Tensor, a_scales: Tensor, b_scales: Tensor, out_dtype: torch.dtype) -> Tensor:
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@torch.library.custom_op("kvforge::fused_moe", mutates_args=())
def _fused_moe_op(hidden: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
    return fused_moe_triton(hidden, w13, w2, topk_weights, topk_ids)


@_fused_moe_op.register_fake
def _(hidden: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
    return hidden.new_empty(hidden.shape)


@torch.library.custom_op("kvforge::mla_decode", mutates_args=())
def _mla_decode_op(
    query: Tensor, latent_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, scale: float, latent_dim: int
) -> Tensor:
    return mla_decode_triton(query, latent_cache, block_tables, seq_lens, scale, latent_dim)


@_mla_decode_op.register_fake
def _(
    query: Tensor, latent_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, scale: float, latent_dim: int
) -> Tensor:
    return query.new_empty((*query.shape[:2], latent_dim))


@dataclass(frozen=True, slots=True)
class OpTable:
    """One implementation of every op."""

    rms_norm: Callable[..., Tensor]
    fused_add_rms_norm: Callable[..., tuple[Tensor, Tensor]]
    rotary_embedding: Callable[..., tuple[Tensor, Tensor]]
    silu_and_mul: Callable[..., Tensor]
    reshape_and_cache: Callable[..., None]
    paged_attention: Callable[..., Tensor]
    quant_gemm: Callable[..., Tensor]
    int8_gemm: Callable[..., Tensor]
    fused_moe: Callable[..., Tensor]
    mla_decode: Callable[..., Tensor]


TORCH_OPS = OpTable(
    rms_norm=rms_norm_ref,
    fused_add_rms_norm=fused_add_rms_norm_ref,
    rotary_embedding=rotary_embedding_ref,
    silu_and_mul=silu_and_mul_ref,
    reshape_and_cache=reshape_and_cache_ref,
    paged_attention=paged_attention_cpu,
    quant_gemm=quant_gemm_ref,
    int8_gemm=int8_gemm_ref,
    fused_moe=fused_moe_cpu,
    mla_decode=mla_decode_ref,
)
TRITON_OPS = OpTable(
    rms_norm=torch.ops.kvforge.rms_norm,
    fused_add_rms_norm=torch.ops.kvforge.fused_add_rms_norm,
    rotary_embedding=torch.ops.kvforge.rotary_embedding,
    silu_and_mul=torch.ops.kvforge.silu_and_mul,
    reshape_and_cache=torch.ops.kvforge.reshape_and_cache,
    paged_attention=torch.ops.kvforge.paged_attention,
    quant_gemm=torch.ops.kvforge.quant_gemm,
    int8_gemm=torch.ops.kvforge.int8_gemm,
    fused_moe=torch.ops.kvforge.fused_moe,
    mla_decode=torch.ops.kvforge.mla_decode,
)

_backend: str = ""  # set, with the op names below, by set_backend() at import


def set_backend(name: str | None = None) -> str:
    """Bind every op to the "torch" or "triton" implementation (None or "auto": the platform's choice).

    Returns the backend in use. Raises ValueError for an unknown name, or "triton" without triton."""
    global _backend, rms_norm, fused_add_rms_norm, rotary_embedding, silu_and_mul
    global reshape_and_cache, paged_attention, quant_gemm, int8_gemm, fused_moe, mla_decode
    _backend = select_backend(name)
    table = TRITON_OPS if _backend == "triton" else TORCH_OPS
    rms_norm = table.rms_norm
    fused_add_rms_norm = table.fused_add_rms_norm
    rotary_embedding = table.rotary_embedding
    silu_and_mul = table.silu_and_mul
    reshape_and_cache = table.reshape_and_cache
    paged_attention = table.paged_attention
    quant_gemm = table.quant_gemm
    int8_gemm = table.int8_gemm
    fused_moe = table.fused_moe
    mla_decode = table.mla_decode
    return _backend


def get_backend() -> str:
    """The backend the ops are bound to: "torch" or "triton"."""
    return _backend


set_backend()

__all__ = [
    "OpTable",
    "TORCH_OPS",
    "TRITON_OPS",
    "fused_add_rms_norm",
    "fused_moe",
    "get_backend",
    "int8_gemm",
    "mla_decode",
    "paged_attention",
    "quant_gemm",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "set_backend",
    "silu_and_mul",
]
