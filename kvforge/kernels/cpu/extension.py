"""The C++ CPU kernels (csrc/), compiled once per machine on first use and cached by torch.

Without a C++ compiler or ninja, `cpu_kernels()` returns None and the caller keeps its pure-torch
path; the reason is logged once. The sources register torch ops (`torch.ops.kvforge_cpu.*`), available
once the module is loaded, each with the fake implementation below, so torch.compile traces them as opaque
nodes:

    quant_gemv(x [M, K], qweight, scales, offsets, bits, int8_activations) -> [M, N] fp32   (quant_gemv.py)
    quant_dequantize(qweight, scales, offsets, bits) -> [N, K] fp32
    quant_gemv_isa() -> "avx512-vnni" | "avx2" | "portable"  (the build's instruction set, logged at engine start)
    quant_gemm_panels(x [M, K], weight, bits, out_features, factor) -> [M, N] fp32   (quant_panels.py, AVX-512 VNNI
        builds)
    pack_panels(codes [N, K], scales [N, G], offsets [N, G] or None, bits, parts, multiplier) -> uint8 [T, bytes]
        (the panel layout, at load time)                                         (quant_panels.py)
    gguf_decode(blocks [N, B, block bytes], type) -> (codes [N, K], scales [N, G], zeros [N, G])   (GGUF blocks
        at load time: quantization/gguf_blocks.py)
    dense_gemv(x [M, K], weight [N, K]) -> [M, N] fp32 (AVX2 builds)             (dense_gemv.py)
    onednn_linear(x [M, K], weight [N, K], bias) -> [M, N] fp32  (oneDNN's matmul; torch builds with mkldnn)
    paged_decode(query [S, H, D], key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale)
        -> [S, H, D]                                                             (paged_attention.py)
    paged_prefill(query [T, H, D], key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, k_scale,
        v_scale) -> [T, H, D], the rows of sequences with more than one query token   (paged_attention.py)
    cache_write(rows [T, ...], cache (mutated), slot_mapping [T])                (../cache_write.py)
    rms_norm(x [T, H], weight, eps) -> [T, H]; fused_add_rms_norm(x, residual, weight, eps) -> (out, residual);
        silu_and_mul(x [T, 2d]) -> [T, d]; rotary_embedding(positions, query, key, cos_sin_cache, is_neox)
        -> (query, key)                                                          (layer_ops.py, eager steps)
    argmax_rows(logits [R, V] fp32) -> [R] int64, each row's first maximum      (argmax.py)
    cache_python_arenas()   CPython's freed arenas and stack chunks kept for reuse (csrc/python_arenas.cpp)

quant_gemm_panels, paged_decode and cache_write also have C entry points (csrc/c_shims.cpp, C_SHIMS below), which
the compiled single-stream step's C++ wrapper calls instead of the dispatcher.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
_SOURCES = [CSRC / name for name in ("argmax.cpp", "c_shims.cpp", "dense_gemv.cpp", "gguf_decode.cpp",
                                        "layer_ops.cpp", "paged_decode.cpp", "paged_prefill.cpp", "panel_pack.cpp",
                                        "quant_gemv.cpp", "quant_gemv_int8.cpp", "quant_panels.cpp",
                                        "python_arenas.cpp")]
DISABLE_ENV = "KVFORGE_NO_CPU_EXTENSION"


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The compiled extension, or None when it cannot be built here (or KVFORGE_NO_CPU_EXTENSION=1)."""
    if os.environ.get(DISABLE_ENV) == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        logger.debug("loading the CPU kernels (the first use on a machine compiles them, ~1 min)")
        # NOTE: a digest of the sources (headers included) and of their folder in the name: two checkouts never
        # share (and rebuild over each other) one build folder, nor load each other's module; torch rebuilds a
        # module whose source paths changed, even when their contents are the same.
        files = sorted(f for f in CSRC.iterdir() if f.suffix in (".cpp", ".h"))
        digest = hashlib.sha256(b"".join([str(CSRC).encode(), *(f.read_bytes() for f in files)])).hexdigest()[:12]
        module = load(
            name=f"kvforge_cpu_kernels_{digest}",
            sources=[str(s) for s in _SOURCES],
            # NOTE: -fopenmp, or at::parallel_for (inlined from torch's headers) runs on one thread. The
            # module then needs libgomp.so.1, which resolves to the copy torch has already loaded.
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
        # NOTE: the module's symbols made global, so that Inductor's compiled C++ wrappers find its C entry points
        # (c_shims.cpp) when they are loaded; Python loads extensions with their symbols local.
        ctypes.CDLL(module.__file__, mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)
    except (OSError, RuntimeError, ImportError) as err:
        logger.warning("CPU kernels unavailable (%s); using the torch attention and quantized-matmul paths", err)
        return None
    _register_fakes()
    return module


# The C entry points of csrc/c_shims.cpp, as Inductor's C++ wrapper declares them (the signatures there).
C_SHIMS = {
    "quant_gemm_panels": "AOTITorchError aoti_torch_cpu_quant_gemm_panels(AtenTensorHandle x, AtenTensorHandle weight, "
    "int64_t bits, int64_t out_features, double factor, AtenTensorHandle* out)",
    "paged_decode": "AOTITorchError aoti_torch_cpu_paged_decode(AtenTensorHandle query, AtenTensorHandle key_cache, "
    "AtenTensorHandle value_cache, AtenTensorHandle block_tables, AtenTensorHandle seq_lens, double scale, "
    "AtenTensorHandle* key_scale, AtenTensorHandle* value_scale, AtenTensorHandle* out)",
    "cache_write": "AOTITorchError aoti_torch_cpu_cache_write(AtenTensorHandle rows, AtenTensorHandle cache, "
    "AtenTensorHandle slot_mapping, AtenTensorHandle* no_result)",
}


class ShimmedOp:
    """One of the ops as a key of Inductor's aot_inductor.custom_ops_to_c_shims: equal to the op, which Inductor
    looks up there, and pickled by its name. NOTE: Inductor's on-disk cache keys a graph on its configuration, which
    it pickles, and an op does not pickle: with the ops themselves as keys, no graph would be cached (measured: the
    default model's single-stream step then compiles in 19.5 s at every start, 5-9 s from the cache)."""

    def __init__(self, name: str) -> None:
        import torch

        self.name = name
        self.op = getattr(torch.ops.kvforge_cpu, name).default

    def __hash__(self) -> int:
        return hash(self.op)

    def __eq__(self, other: object) -> bool:
        return other is self.op or (isinstance(other, ShimmedOp) and other.name == self.name)

    def __reduce__(self) -> tuple:
        return ShimmedOp, (self.name,)


def c_shims() -> dict[ShimmedOp, list[str]]:
    """{op: [its C entry point's declaration]} for Inductor's aot_inductor.custom_ops_to_c_shims: a compiled C++
    wrapper then calls these ops directly instead of through the dispatcher (needs the extension loaded)."""
    return {ShimmedOp(name): [declaration] for name, declaration in C_SHIMS.items()}


def keep_python_memory() -> None:
    """What a CPU worker does at start: CPython's freed arenas and stack chunks are cached instead of unmapped
    (each munmap flushes the TLB of the process's OpenMP threads; csrc/python_arenas.cpp has the measurement)."""
    if cpu_kernels() is not None:
        import torch

        torch.ops.kvforge_cpu.cache_python_arenas()


def cpu_kernels_isa() -> str:
    """What a CPU engine logs at start: the instruction set the kernels were built for (-march=native picks it)"""
    if cpu_kernels() is None:
        return "not built (torch fallbacks)"
    import torch

    return torch.ops.kvforge_cpu.quant_gemv_isa()


def _register_fakes() -> None:
    """Shapes and dtypes of the ops' results, for tracing. Called once, after the library is loaded."""
    import torch

    def rows_of(qweight: torch.Tensor, bits: int) -> tuple[int, int]:
        return qweight.shape[0], qweight.shape[1] * 8 // bits

    @torch.library.register_fake("kvforge_cpu::quant_gemv")
    def _(x, qweight, scales, offsets, bits, int8_activations):
        return x.new_empty((x.shape[0], qweight.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("kvforge_cpu::quant_gemm_panels")
    def _(x, weight, bits, out_features, factor):
        return x.new_empty((x.shape[0], out_features), dtype=torch.float32)

    @torch.library.register_fake("kvforge_cpu::quant_dequantize")
    def _(qweight, scales, offsets, bits):
        return scales.new_empty(rows_of(qweight, bits), dtype=torch.float32)

    @torch.library.register_fake("kvforge_cpu::dense_gemv")
    def _(x, weight):
        return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("kvforge_cpu::onednn_linear")
    def _(x, weight, bias):
        return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("kvforge_cpu::paged_decode")
    def _(query, key_cache, value_cache, block_tables, seq_lens, scale, key_scale=None, value_scale=None):
        return torch.empty_like(query)

    @torch.library.register_fake("kvforge_cpu::paged_prefill")
    def _(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, key_scale=None,
          value_scale=None):
        return torch.empty_like(query)

    @torch.library.register_fake("kvforge_cpu::cache_write")
    def _(rows, cache, slot_mapping):
        return None

    @torch.library.register_fake("kvforge_cpu::argmax_rows")
    def _(logits):
        return logits.new_empty((logits.shape[0],), dtype=torch.int64)

    @torch.library.register_fake("kvforge_cpu::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.register_fake("kvforge_cpu::fused_add_rms_norm")
    def _(x, residual, weight, eps):
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.register_fake("kvforge_cpu::silu_and_mul")
    def _(x):
        return x.new_empty((x.shape[0], x.shape[1] // 2))

    @torch.library.register_fake("kvforge_cpu::rotary_embedding")
    def _(positions, query, key, cos_sin_cache, is_neox):
        return query.new_empty(query.shape), key.new_empty(key.shape)
