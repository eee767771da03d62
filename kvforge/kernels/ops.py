"""The ops the model calls, one table of implementations per engine: `self.ops.rms_norm(...)`.

An `OpTable` holds one implementation of every op. `op_table(backend)` builds the table of a backend:
Triton on CUDA and ROCm, the torch references on the CPU (with the C++ CPU kernels where they are built).
A worker builds its model `building_with_ops(table)`, and every layer captures `current_ops()` when it is
constructed, the way layers capture the parallel state (distributed/parallel_state.building_with): two engines
with different backends live side by side in one process, and nothing rebinds an op later. To wrap an
engine's ops (e.g. to time them), replace a layer's `ops` with `dataclasses.replace(table, name=wrapped)`.

The Triton launchers are registered as `torch.library` custom ops (`torch.ops.kvforge.*`) with fake
implementations, so torch.compile traces them as opaque nodes and CUDA graphs capture them; so are the C++
CPU kernels (`torch.ops.kvforge_cpu.*`, kernels/cpu/extension.py). The torch backend binds the references
directly: they are plain torch code that compile traces through, and a Python custom op in front of them
only adds dispatch time on the CPU hot path (measured: 25-100 us per call on a 2-core CPU, against 50-130
us for the rms_norm reference itself).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvforge.build_scope import BuildScope
from kvforge.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from kvforge.kernels.cache_write import reshape_and_cache_cpu, reshape_and_cache_ref, reshape_and_cache_triton
from kvforge.kernels.causal_conv1d import causal_conv1d_ref, causal_conv1d_triton
from kvforge.kernels.cpu.extension import cpu_kernels
from kvforge.kernels.cpu.layer_ops import (
    fused_add_rms_norm_cpu,
    layer_norm_cpu,
    rms_norm_cpu,
    rotary_embedding_cpu,
    silu_and_mul_cpu,
)
from kvforge.kernels.cpu.lora import lora_fused_cpu
from kvforge.kernels.cpu.paged_attention import paged_attention_cpu, paged_decode_cpu
from kvforge.kernels.fused_moe import fused_moe_cpu, fused_moe_triton
from kvforge.kernels.gated_delta_rule import (
    gated_delta_decode_ref,
    gated_delta_decode_triton,
    gated_delta_prefill_ref,
    gated_delta_prefill_triton,
)
from kvforge.kernels.int8_gemm import int8_gemm_ref, int8_gemm_triton
from kvforge.kernels.layer_norm import layer_norm_ref
from kvforge.kernels.lora import lora_expand_cpu, lora_expand_triton, lora_shrink_cpu, lora_shrink_triton
from kvforge.kernels.mla_decode import mla_decode_ref, mla_decode_triton
from kvforge.kernels.moe_lora import ExpertLoRA
from kvforge.kernels.mxfp4_moe import mxfp4_moe_cpu, mxfp4_moe_triton
from kvforge.kernels.paged_attention import paged_attention_triton
from kvforge.kernels.quant_gemm import quant_gemm_ref, quant_gemm_triton
from kvforge.kernels.rms_norm import (
    fused_add_rms_norm_ref,
    fused_add_rms_norm_triton,
    rms_norm_ref,
    rms_norm_triton,
)
from kvforge.kernels.rotary import rotary_embedding_ref, rotary_embedding_triton
from kvforge.platforms import Platform, current_platform, launch_platform, select_backend

Tensor = torch.Tensor


@torch.library.custom_op("kvforge::rms_norm", mutates_args=())
def _rms_norm_op(x: Tensor, weight: Tensor, eps: float, platform: str = "") -> Tensor:
    return rms_norm_triton(x, weight, eps, platform=launch_platform(platform))


@_rms_norm_op.register_fake
def _(x: Tensor, weight: Tensor, eps: float, platform: str = "") -> Tensor:
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


@torch.library.custom_op("kvforge::fused_add_rms_norm", mutates_args=())
def _fused_add_rms_norm_op(x: Tensor, residual: Tensor, weight: Tensor, eps: float, platform: str = ""
      ) -> tuple[Tensor, Tensor]:
    return fused_add_rms_norm_triton(x, residual, weight, eps, platform=launch_platform(platform))


@_fused_add_rms_norm_op.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor, eps: float, platform: str = ""
      ) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)), x.new_empty(x.shape)


@torch.library.custom_op("kvforge::rotary_embedding", mutates_args=())
def _rotary_embedding_op(
    positions: Tensor, query: Tensor, key: Tensor, cos_sin_cache: Tensor, is_neox: bool, platform: str = ""
) -> tuple[Tensor, Tensor]:
    return rotary_embedding_triton(positions, query, key, cos_sin_cache, is_neox, platform=launch_platform(platform))


@_rotary_embedding_op.register_fake
def _(
    positions: Tensor, query: Tensor, key: Tensor, cos_sin_cache: Tensor, is_neox: bool, platform: str = ""
) -> tuple[Tensor, Tensor]:
    return query.new_empty(query.shape), key.new_empty(key.shape)


@torch.library.custom_op("kvforge::silu_and_mul", mutates_args=())
def _silu_and_mul_op(x: Tensor, platform: str = "") -> Tensor:
    return silu_and_mul_triton(x, platform=launch_platform(platform))


@_silu_and_mul_op.register_fake
def _(x: Tensor, platform: str = "") -> Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@torch.library.custom_op(
    "kvforge::reshape_and_cache", mutates_args=("key_cache", "value_cache", "key_scale", "value_scale")
)
def _reshape_and_cache_op(
    key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor,
    key_scale: Tensor | None = None, value_scale: Tensor | None = None, platform: str = "",
) -> None:  # fmt: skip
    reshape_and_cache_triton(key, value, key_cache, value_cache, slot_mapping, key_scale, value_scale,
                             platform=launch_platform(platform))


@_reshape_and_cache_op.register_fake
def _(
    key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor,
    key_scale: Tensor | None = None, value_scale: Tensor | None = None, platform: str = "",
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
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: Tensor | None = None,
    platform: str = "",
) -> Tensor:
    return paged_attention_triton(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
                                  key_scale, value_scale, sliding_window, softcap, sinks,
                                  platform=launch_platform(platform))


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
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: Tensor | None = None,
    platform: str = "",
) -> Tensor:
    return query.new_empty(query.shape)


@torch.library.custom_op("kvforge::quant_gemm", mutates_args=())
def _quant_gemm_op(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor, bits: int, platform: str = "") -> Tensor:
    return quant_gemm_triton(x, qweight, scales, zeros, bits, platform=launch_platform(platform))


@_quant_gemm_op.register_fake
def _(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor, bits: int, platform: str = "") -> Tensor:
    return x.new_empty((x.shape[0], qweight.shape[0]))


@torch.library.custom_op("kvforge::int8_gemm", mutates_args=())
def _int8_gemm_op(a: Tensor, b: Tensor, a_scales: Tensor, b_scales: Tensor, out_dtype: torch.dtype,
      platform: str = "") -> Tensor:
    return int8_gemm_triton(a, b, a_scales, b_scales, out_dtype, platform=launch_platform(platform))


@_int8_gemm_op.register_fake
def _(a: Tensor, b: Tensor, a_scales: Tensor, b_scales: Tensor, out_dtype: torch.dtype,
      platform: str = "") -> Tensor:
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@torch.library.custom_op("kvforge::fused_moe", mutates_args=())
def _fused_moe_op(
    hidden: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor, lora_a13: Tensor | None = None,
    lora_b13: Tensor | None = None, lora_a2: Tensor | None = None, lora_b2: Tensor | None = None,
    lora_token_slots: Tensor | None = None, platform: str = "",
) -> Tensor:  # fmt: skip
    lora = None if lora_a13 is None else ExpertLoRA(lora_a13, lora_b13, lora_a2, lora_b2, lora_token_slots)
    return fused_moe_triton(hidden, w13, w2, topk_weights, topk_ids, lora, platform=launch_platform(platform))


@_fused_moe_op.register_fake
def _(
    hidden: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor, lora_a13: Tensor | None = None,
    lora_b13: Tensor | None = None, lora_a2: Tensor | None = None, lora_b2: Tensor | None = None,
    lora_token_slots: Tensor | None = None, platform: str = "",
) -> Tensor:  # fmt: skip
    return hidden.new_empty(hidden.shape)


def _fused_moe_triton_op(hidden: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                         lora: ExpertLoRA | None = None, platform: str = "") -> Tensor:
    """The fused_moe custom op with the experts' LoRA slots (a tuple of tensors) as its last arguments."""
    return torch.ops.kvforge.fused_moe(hidden, w13, w2, topk_weights, topk_ids, *(lora or ()), platform=platform)


@torch.library.custom_op("kvforge::mxfp4_moe", mutates_args=())
def _mxfp4_moe_op(
    hidden: Tensor, w13_blocks: Tensor, w13_scales: Tensor, w13_bias: Tensor, w2_blocks: Tensor, w2_scales: Tensor,
    w2_bias: Tensor, topk_weights: Tensor, topk_ids: Tensor, alpha: float, limit: float, platform: str = "",
) -> Tensor:  # fmt: skip
    return mxfp4_moe_triton(hidden, w13_blocks, w13_scales, w13_bias, w2_blocks, w2_scales, w2_bias, topk_weights,
                            topk_ids, alpha, limit, platform=launch_platform(platform))  # fmt: skip


@_mxfp4_moe_op.register_fake
def _(
    hidden: Tensor, w13_blocks: Tensor, w13_scales: Tensor, w13_bias: Tensor, w2_blocks: Tensor, w2_scales: Tensor,
    w2_bias: Tensor, topk_weights: Tensor, topk_ids: Tensor, alpha: float, limit: float, platform: str = "",
) -> Tensor:  # fmt: skip
    return hidden.new_empty(hidden.shape)


@torch.library.custom_op("kvforge::mla_decode", mutates_args=())
def _mla_decode_op(
    query: Tensor, latent_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, scale: float, latent_dim: int,
    platform: str = "",
) -> Tensor:
    return mla_decode_triton(query, latent_cache, block_tables, seq_lens, scale, latent_dim,
                             platform=launch_platform(platform))


@_mla_decode_op.register_fake
def _(
    query: Tensor, latent_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, scale: float, latent_dim: int,
    platform: str = "",
) -> Tensor:
    return query.new_empty((*query.shape[:2], latent_dim))


@torch.library.custom_op("kvforge::lora_shrink", mutates_args=())
def _lora_shrink_op(x: Tensor, a: Tensor, slots: Tensor, platform: str = "") -> Tensor:
    return lora_shrink_triton(x, a, slots, platform=launch_platform(platform))


@_lora_shrink_op.register_fake
def _(x: Tensor, a: Tensor, slots: Tensor, platform: str = "") -> Tensor:
    return x.new_empty((x.shape[0], a.shape[1]))


@torch.library.custom_op("kvforge::lora_expand", mutates_args=())
def _lora_expand_op(h: Tensor, b: Tensor, slots: Tensor, y: Tensor, platform: str = "") -> Tensor:
    return lora_expand_triton(h, b, slots, y, platform=launch_platform(platform))


@_lora_expand_op.register_fake
def _(h: Tensor, b: Tensor, slots: Tensor, y: Tensor, platform: str = "") -> Tensor:
    return y.new_empty(y.shape)


@torch.library.custom_op("kvforge::gated_delta_prefill", mutates_args=("state",))
def _gated_delta_prefill_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, query_start_loc: Tensor,
    slot_ids: Tensor, has_initial_state: Tensor,
) -> Tensor:  # fmt: skip
    return gated_delta_prefill_triton(q, k, v, g, beta, state, query_start_loc, slot_ids, has_initial_state)


@_gated_delta_prefill_op.register_fake
def _(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, query_start_loc: Tensor,
    slot_ids: Tensor, has_initial_state: Tensor,
) -> Tensor:  # fmt: skip
    return v.new_empty(v.shape)


@torch.library.custom_op("kvforge::gated_delta_decode", mutates_args=("state",))
def _gated_delta_decode_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, slot_ids: Tensor,
    has_initial_state: Tensor,
) -> Tensor:  # fmt: skip
    return gated_delta_decode_triton(q, k, v, g, beta, state, slot_ids, has_initial_state)


@_gated_delta_decode_op.register_fake
def _(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, slot_ids: Tensor,
    has_initial_state: Tensor,
) -> Tensor:  # fmt: skip
    return v.new_empty(v.shape)


@torch.library.custom_op("kvforge::causal_conv1d", mutates_args=("conv_state",))
def _causal_conv1d_op(
    x: Tensor, weight: Tensor, bias: Tensor | None, conv_state: Tensor, query_start_loc: Tensor, slot_ids: Tensor,
    has_initial_state: Tensor, silu: bool,
) -> Tensor:  # fmt: skip
    return causal_conv1d_triton(x, weight, bias, conv_state, query_start_loc, slot_ids, has_initial_state, silu)


@_causal_conv1d_op.register_fake
def _(
    x: Tensor, weight: Tensor, bias: Tensor | None, conv_state: Tensor, query_start_loc: Tensor, slot_ids: Tensor,
    has_initial_state: Tensor, silu: bool,
) -> Tensor:  # fmt: skip
    return x.new_empty(x.shape)


@dataclass(frozen=True, slots=True)
class OpTable:
    """One implementation of every op. paged_decode takes paged_attention's arguments for a step whose every
    sequence has one query token (a decode-only step), for which the CPU has a kernel of its own."""

    backend: str  # "torch" or "triton"
    traces: bool  # torch.compile traces every op (no host sync inside): the decode step can be compiled
    rms_norm: Callable[..., Tensor]
    fused_add_rms_norm: Callable[..., tuple[Tensor, Tensor]]
    layer_norm: Callable[..., Tensor]  # the reference on GPUs, where torch.compile fuses it
    rotary_embedding: Callable[..., tuple[Tensor, Tensor]]
    silu_and_mul: Callable[..., Tensor]
    reshape_and_cache: Callable[..., None]
    paged_attention: Callable[..., Tensor]
    paged_decode: Callable[..., Tensor]
    quant_gemm: Callable[..., Tensor]
    int8_gemm: Callable[..., Tensor]
    fused_moe: Callable[..., Tensor]
    mxfp4_moe: Callable[..., Tensor]
    mla_decode: Callable[..., Tensor]
    lora_shrink: Callable[..., Tensor]
    lora_expand: Callable[..., Tensor]
    gated_delta_prefill: Callable[..., Tensor]  # mutates its state argument
    gated_delta_decode: Callable[..., Tensor]  # mutates its state argument
    causal_conv1d: Callable[..., Tensor]  # mutates its conv_state argument
    # a LoRA layer's whole update in one op, its A and B kept transposed (kernels/lora.py: lora_fused_ref); None: the
    # shrink, then an expand per checkpoint matrix
    lora_fused: Callable[..., Tensor] | None = None
    # The platform whose tuning table and device size the launches read (`for_platform`); None: the current
    # platform's at each launch (the unbound TRITON_OPS; the torch backend's ops read none).
    platform: Platform | None = None


def _paged_decode_cpu(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                      query_start_loc: Tensor, seq_lens: Tensor, scale: float, key_scale: Tensor | None = None,
                      value_scale: Tensor | None = None, sliding_window: int = 0, softcap: float = 0.0,
                      sinks: Tensor | None = None) -> Tensor:  # fmt: skip
    """paged_attention's arguments -> the C++ decode kernel (one row per sequence: no query_start_loc)."""
    return paged_decode_cpu(query, key_cache, value_cache, block_tables, seq_lens, scale, key_scale, value_scale,
                            sliding_window, softcap, sinks)


TORCH_OPS = OpTable(
    backend="torch",
    traces=False,
    rms_norm=rms_norm_ref,
    fused_add_rms_norm=fused_add_rms_norm_ref,
    layer_norm=layer_norm_ref,
    rotary_embedding=rotary_embedding_ref,
    silu_and_mul=silu_and_mul_ref,
    reshape_and_cache=reshape_and_cache_ref,
    paged_attention=paged_attention_cpu,
    paged_decode=paged_attention_cpu,
    quant_gemm=quant_gemm_ref,
    int8_gemm=int8_gemm_ref,
    fused_moe=fused_moe_cpu,
    mxfp4_moe=mxfp4_moe_cpu,
    mla_decode=mla_decode_ref,
    lora_shrink=lora_shrink_cpu,
    lora_expand=lora_expand_cpu,
    gated_delta_prefill=gated_delta_prefill_ref,
    gated_delta_decode=gated_delta_decode_ref,
    causal_conv1d=causal_conv1d_ref,
)
TRITON_OPS = OpTable(  # unbound: its launches read the current platform (bound per engine by for_platform)
    backend="triton",
    traces=True,
    rms_norm=torch.ops.kvforge.rms_norm,
    fused_add_rms_norm=torch.ops.kvforge.fused_add_rms_norm,
    layer_norm=layer_norm_ref,
    rotary_embedding=torch.ops.kvforge.rotary_embedding,
    silu_and_mul=torch.ops.kvforge.silu_and_mul,
    reshape_and_cache=torch.ops.kvforge.reshape_and_cache,
    paged_attention=torch.ops.kvforge.paged_attention,
    paged_decode=torch.ops.kvforge.paged_attention,
    quant_gemm=torch.ops.kvforge.quant_gemm,
    int8_gemm=torch.ops.kvforge.int8_gemm,
    fused_moe=_fused_moe_triton_op,
    mxfp4_moe=torch.ops.kvforge.mxfp4_moe,
    mla_decode=torch.ops.kvforge.mla_decode,
    lora_shrink=torch.ops.kvforge.lora_shrink,
    lora_expand=torch.ops.kvforge.lora_expand,
    gated_delta_prefill=torch.ops.kvforge.gated_delta_prefill,
    gated_delta_decode=torch.ops.kvforge.gated_delta_decode,
    causal_conv1d=torch.ops.kvforge.causal_conv1d,
)


@functools.cache
def _cpu_ops() -> OpTable:
    """The torch backend with the C++ CPU kernels, where they build: the cache write and decode attention trace
    (no host sync), so a compiled decode step holds them as opaque ops; the norms, activation and rotary run their
    kernels in eager steps and their references under tracing (kernels/cpu/layer_ops.py)."""
    if cpu_kernels() is None:
        return TORCH_OPS
    return dataclasses.replace(TORCH_OPS, traces=True, reshape_and_cache=reshape_and_cache_cpu,
                               paged_decode=_paged_decode_cpu, rms_norm=rms_norm_cpu,
                               fused_add_rms_norm=fused_add_rms_norm_cpu, layer_norm=layer_norm_cpu,
                               rotary_embedding=rotary_embedding_cpu,
                               silu_and_mul=silu_and_mul_cpu, lora_fused=lora_fused_cpu)


# The ops whose Triton launches read the platform (tiles, device size, fp8, LoRA's segmenting threshold), each taking
# its launch key; the gated delta rule and causal conv1d kernels' fixed blocks and warps read none.
_PLATFORM_OPS = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "reshape_and_cache",
                 "paged_attention", "paged_decode", "quant_gemm", "int8_gemm", "fused_moe", "mxfp4_moe", "mla_decode",
                 "lora_shrink", "lora_expand")


@functools.cache
def for_platform(table: OpTable, platform: Platform) -> OpTable:
    """table with its Triton launches bound to platform's tiles and device size: each op called with the platform's
    launch key (Platform.launch_key), so that the choice belongs to the table (an engine's) and not to the process.
    The torch backend's ops read no platform: its table only records it."""
    if table.backend != "triton":
        return dataclasses.replace(table, platform=platform)
    bound = {name: functools.partial(getattr(table, name), platform=platform.launch_key) for name in _PLATFORM_OPS}
    return dataclasses.replace(table, platform=platform, **bound)


def op_table(backend: str | None = None, platform: Platform | None = None) -> OpTable:
    """The ops of the "torch" or "triton" backend (None or "auto": the platform's choice) for platform (None: the
    current one, as detected or pinned), bound to it once (`for_platform`).

    Raises ValueError for an unknown name, or "triton" without triton."""
    platform = platform if platform is not None else current_platform()
    return for_platform(TRITON_OPS if select_backend(backend, platform) == "triton" else _cpu_ops(), platform)


# The table a model is built with (`building_with_ops(table)`: its layers capture `current_ops()`); the platform's
# choice outside.
OPS = BuildScope("op table", op_table)
current_ops = OPS.current
building_with_ops = OPS.building_with


__all__ = ["TORCH_OPS", "TRITON_OPS", "OpTable", "building_with_ops", "current_ops", "for_platform", "op_table"]
