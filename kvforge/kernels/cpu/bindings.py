"""The ops of the C++ CPU kernels (csrc/), declared once: each op's torch schema, the shapes of its results (the fake
implementation torch.compile traces with), the dispatch keys its kernel serves and whether Inductor's C++ wrapper
calls it through a C entry point. Everything else about an op is derived from its declaration here:

    the C++ declaration of its kernel, the TORCH_LIBRARY definition and registration, and its C entry point
        builds.generated_sources(): written at build time (setup.py, and the first-use build in extension.py)
        beside the build, never into csrc/; the kernel files include the generated "ops.h"
    its fake implementation (torch.library.register_fake)           extension.py, when the kernels load
    its C entry point's declaration for Inductor                    extension.py's c_shims()

Adding an op: a declaration below, and its kernel in a csrc/ file, a function `kvforge_cpu::<name>` with the C++
types of its schema (builds.CPP_TYPES: Tensor -> at::Tensor by value, Tensor? -> std::optional<at::Tensor>, int ->
int64_t, float -> double, ...), as the generated ops.h declares it. A kernel of other types is another function:
loading the build then fails on the declared one's undefined symbol. docs/architecture.md walks through it.

This file imports nothing but the standard library: setup.py reads it (through builds.py) without torch's ops loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

NAMESPACE = "kvforge_cpu"


@dataclass(frozen=True, slots=True)
class Op:
    """One op: `schema` as torch.library takes it ("name(Type arg, ...) -> Results"); `outputs(args)` builds its
    results' empty tensors from its arguments by name (None: no fake, an op that is never traced); `dispatch`, the
    keys its kernel is registered for (ops without tensor arguments are registered for every key, whatever this
    says); `c_shim`, whether it has a C entry point for Inductor's C++ wrapper (Tensor, Tensor?, int and float
    arguments; one Tensor or no result)."""

    schema: str
    outputs: Callable[[SimpleNamespace], object] | None = None
    dispatch: tuple[str, ...] = ("CPU",)
    c_shim: bool = False

    @property
    def name(self) -> str:
        return self.schema.partition("(")[0]


def like(tensor):
    """An empty tensor of the shape, dtype and strides of `tensor`."""
    import torch

    return torch.empty_like(tensor)


def new(tensor, *shape: int, dtype: str | None = None):
    """An empty contiguous tensor of `shape` on `tensor`'s device, of its dtype unless `dtype` names another."""
    import torch

    return tensor.new_empty(shape, dtype=getattr(torch, dtype) if dtype else None)


_PAGED = ("Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, {}Tensor seq_lens, float scale, "
          "Tensor? key_scale=None, Tensor? value_scale=None, int sliding_window=0, float softcap=0.0, "
          "Tensor? sinks=None")

OPS = (
    # quant_gemv.cpp, quant_gemv_int8.cpp (quant_gemv.py)
    Op("quant_gemv(Tensor x, Tensor qweight, Tensor scales, Tensor offsets, int bits, bool int8_activations) "
       "-> Tensor", lambda a: new(a.x, a.x.shape[0], a.qweight.shape[0], dtype="float32")),
    Op("quant_dequantize(Tensor qweight, Tensor scales, Tensor offsets, int bits) -> Tensor",
       lambda a: new(a.scales, a.qweight.shape[0], a.qweight.shape[1] * 8 // a.bits, dtype="float32")),
    Op("quant_gemv_vectorized() -> bool"),
    Op("quant_gemv_isa() -> str"),  # the build's instruction set, logged at engine start
    # quant_panels.cpp, panel_pack.cpp (quant_panels.py)
    Op("quant_gemm_panels(Tensor x, Tensor weight, int bits, int out_features, float factor) -> Tensor",
       lambda a: new(a.x, a.x.shape[0], a.out_features, dtype="float32"), c_shim=True),
    Op("quant_panels_available() -> bool"),
    Op("panel_factors(Tensor[] scales, Tensor[] zeros, int bits) -> (bool, float)"),
    Op("panel_super_scales(Tensor[] codes, Tensor[] scales, Tensor[] zeros, int bits, bool symmetric) -> Tensor[]"),
    Op("pack_panels(Tensor[] codes, Tensor[] scales, Tensor[] zeros, Tensor[] super_scales, int bits, bool symmetric, "
       "float multiplier, Tensor(a!) out) -> ()"),
    # gguf_decode.cpp (quantization/gguf_blocks.py, at load time)
    Op("gguf_decode(Tensor blocks, int type) -> (Tensor, Tensor, Tensor)"),
    # dense_gemv.cpp (dense_gemv.py); onednn_linear also takes weights packed by oneDNN, which dispatch to MkldnnCPU
    Op("dense_gemv(Tensor x, Tensor weight) -> Tensor",
       lambda a: new(a.x, a.x.shape[0], a.weight.shape[0], dtype="float32")),
    Op("onednn_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
       lambda a: new(a.x, a.x.shape[0], a.weight.shape[0], dtype="float32"), dispatch=("CPU", "MkldnnCPU")),
    # bf16_gemm.cpp (bf16_gemm.py): float32 in and out, bfloat16 products (AMX), the weight packed once at load
    Op("bf16_gemm(Tensor x, Tensor packed, Tensor? bias, int activation) -> Tensor",
       lambda a: new(a.x, a.x.shape[0], a.packed.shape[0] * 16, dtype="float32")),
    Op("bf16_gemm_pack(Tensor weight) -> Tensor"),
    Op("bf16_gemm_supported() -> bool"),
    # half_gemv.cpp (half_gemv.py)
    Op("half_gemv(Tensor x, Tensor weight, int vector_bits=0) -> Tensor",
       lambda a: new(a.x, a.x.shape[0], a.weight.shape[0], dtype="float32")),
    Op("half_gemv_widest() -> int"),
    # paged_decode.cpp, paged_prefill.cpp (paged_attention.py; cache_write: ../cache_write.py)
    Op(f"paged_decode({_PAGED.format('')}) -> Tensor", lambda a: like(a.query), c_shim=True),
    Op(f"paged_prefill({_PAGED.format('Tensor query_start_loc, ')}) -> Tensor", lambda a: like(a.query)),
    Op("cache_write(Tensor rows, Tensor(a!) cache, Tensor slot_mapping) -> ()", lambda a: None, c_shim=True),
    # varlen_attention.cpp (layers/attention.py, pooling steps): each sequence of a flat batch attended within itself
    Op("varlen_attention(Tensor query, Tensor key, Tensor value, Tensor query_start_loc, float scale, bool causal) "
       "-> Tensor", lambda a: new(a.query, *a.query.shape)),
    # layer_ops.cpp (layer_ops.py)
    Op("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", lambda a: like(a.x)),
    Op("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
       lambda a: (like(a.x), like(a.x))),
    # layer_norm.cpp (layer_ops.py): LayerNorm(x + residual) of the encoders' post-norm layers; its scalar loop (tests)
    Op("layer_norm(Tensor x, Tensor? residual, Tensor weight, Tensor bias, float eps) -> Tensor", lambda a: like(a.x)),
    Op("layer_norm_scalar(Tensor x, Tensor? residual, Tensor weight, Tensor bias, float eps) -> Tensor",
       lambda a: like(a.x)),
    Op("silu_and_mul(Tensor x) -> Tensor", lambda a: new(a.x, a.x.shape[0], a.x.shape[1] // 2)),
    Op("rotary_embedding(Tensor positions, Tensor query, Tensor key, Tensor cos_sin_cache, bool is_neox) "
       "-> (Tensor, Tensor)", lambda a: (new(a.query, *a.query.shape), new(a.key, *a.key.shape))),
    # argmax.cpp (argmax.py)
    Op("argmax_rows(Tensor logits) -> Tensor", lambda a: new(a.logits, a.logits.shape[0], dtype="int64")),
    # lora.cpp (lora.py): each row's LoRA update added into y in place, the rows grouped by adapter (a: A^T [S, K, W],
    # bt: B^T [S, R, N_m] per matrix); traced opaquely in the compiled decode steps
    Op("lora_apply(Tensor(a!) y, Tensor x, Tensor a, Tensor[] bt, Tensor slots) -> ()", lambda a: None),
    # python_arenas.cpp
    Op("cache_python_arenas() -> ()"),
)
