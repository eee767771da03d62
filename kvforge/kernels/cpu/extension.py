"""The C++ CPU kernels (csrc/): the build of them that this CPU runs best, loaded once per process.

A kvforge package comes with its kernels compiled, one build per instruction set (builds.py, setup.py); the best one
this CPU's flags allow is loaded (`KVFORGE_CPU_VARIANT=avx2`, say, chooses a lesser one). Where none came with it for
these sources (a source checkout, or one whose kernels were edited since its build), they are compiled for this CPU
on first use (-march=native, 1-3 minutes once, then cached by torch), and the log says so.
Where that compile fails (no C++ compiler, no ninja), `cpu_kernels()` returns None and the callers keep their torch
paths, several times slower: a warning says so, and `kvforge env` shows what the engine uses.

The sources register torch ops (`torch.ops.kvforge_cpu.*`), available once the module is loaded, each with the fake
implementation below, so torch.compile traces them as opaque nodes:

    quant_gemv(x [M, K], qweight, scales, offsets, bits, int8_activations) -> [M, N] fp32   (quant_gemv.py)
    quant_dequantize(qweight, scales, offsets, bits) -> [N, K] fp32
    quant_gemv_isa() -> "avx512-vnni" | "avx2" | "portable"  (the build's instruction set, logged at engine start)
    quant_gemm_panels(x [M, K], weight, bits, out_features, factor) -> [M, N] fp32   (quant_panels.py, AVX-512 VNNI
        builds)
    panel_factors(scales [], zeros [], bits) -> (symmetric, largest |scale| or |offset|)   (a weight's row shards)
    pack_panels(codes [], scales [], zeros [], bits, symmetric, multiplier, out uint8 [T, >= part bytes]) -> ()
        (the panel layout of a weight's row shards, written into out at load time)   (quant_panels.py)
    gguf_decode(blocks [N, B, block bytes], type) -> (codes [N, K], scales [N, G], zeros [N, G])   (GGUF blocks
        at load time: quantization/gguf_blocks.py)
    dense_gemv(x [M, K], weight [N, K]) -> [M, N] fp32 (AVX2 builds)             (dense_gemv.py)
    half_gemv(x [M, K], weight [N, K] fp16 | bf16, vector_bits) -> [M, N] fp32 (AVX2 + F16C builds; 512-bit
        vectors in AVX-512 ones; half_gemv_widest() says which)                 (half_gemv.py)
    onednn_linear(x [M, K], weight [N, K], bias) -> [M, N] fp32  (oneDNN's matmul; torch builds with mkldnn)
    paged_decode(query [S, H, D], key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale,
        sliding_window, softcap, sinks) -> [S, H, D]                             (paged_attention.py)
    paged_prefill(query [T, H, D], key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, k_scale,
        v_scale, sliding_window, softcap, sinks) -> [T, H, D], the rows of sequences with more than one query token
                                                                                 (paged_attention.py)
    varlen_attention(query [T, H, D], key [T, Hkv, D], value, query_start_loc [S + 1] int64, scale, causal)
        -> [T, H, D], each sequence of the flat batch attended within itself   (layers/attention.py, pooling steps)
    cache_write(rows [T, ...], cache (mutated), slot_mapping [T])                (../cache_write.py)
    rms_norm(x [T, H], weight, eps) -> [T, H]; fused_add_rms_norm(x, residual, weight, eps) -> (out, residual);
        silu_and_mul(x [T, 2d]) -> [T, d]; rotary_embedding(positions, query, key, cos_sin_cache, is_neox)
        -> (query, key)                                                          (layer_ops.py, eager steps)
    argmax_rows(logits [R, V] fp32) -> [R] int64, each row's first maximum      (argmax.py)
    lora_apply(y [T, N] (mutated), x [T, K], a [S, W, K], bt [S, R, N_m] per matrix, slots [T]) -> (), each row's
        LoRA update added into y, the rows grouped by adapter                    (lora.py)
    cache_python_arenas()   CPython's freed arenas and stack chunks kept for reuse (csrc/python_arenas.cpp)

quant_gemm_panels, paged_decode and cache_write also have C entry points (csrc/c_shims.cpp, C_SHIMS below), which
the compiled single-stream step's C++ wrapper calls instead of the dispatcher.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib
import importlib.util
import logging
import os
import platform
from dataclasses import dataclass
from types import ModuleType

from kvforge.kernels.cpu import builds

logger = logging.getLogger(__name__)

CSRC = builds.CSRC
DISABLE_ENV = "KVFORGE_NO_CPU_EXTENSION"
VARIANT_ENV = "KVFORGE_CPU_VARIANT"  # the built variant to load (an ISA name), where this CPU runs it


@dataclass(frozen=True, slots=True)
class KernelsBuild:
    """The C++ kernels this process uses: the loaded module, how it was built (`origin`) and its file, or None and
    why not (`origin` says so)."""

    module: ModuleType | None
    origin: str
    path: str | None = None

    def describe(self) -> str:
        """One line for the log and `kvforge env`: the ISA and how it was built, with the file; or why none."""
        if self.module is None:
            return f"not built (torch fallbacks): {self.origin}"
        import torch

        return f"{torch.ops.kvforge_cpu.quant_gemv_isa()}, {self.origin} ({self.path})"


@functools.cache
def kernels_build() -> KernelsBuild:
    """Loads the kernels once per process: the best variant built with the package that this CPU runs, else a build
    for this CPU compiled on first use (logged); None in `module` where that fails or KVFORGE_NO_CPU_EXTENSION=1."""
    if os.environ.get(DISABLE_ENV) == "1":
        return KernelsBuild(None, f"{DISABLE_ENV}=1")
    build = _built_with_package() or _compiled_on_first_use()
    if build.module is not None:
        # NOTE: the module's symbols made global, so that Inductor's compiled C++ wrappers find its C entry points
        # (c_shims.cpp) when they are loaded; Python loads extensions with their symbols local.
        ctypes.CDLL(build.path, mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)
        _register_fakes()
    return build


def cpu_kernels() -> ModuleType | None:
    """The loaded extension, or None when there is none (kernels_build() says why)."""
    return kernels_build().module


def _candidates() -> tuple[builds.Variant, ...]:
    """The variants this CPU runs, best first; only the one named by KVFORGE_CPU_VARIANT when it runs here."""
    runnable = builds.runnable(builds.cpu_flags(), platform.machine())
    wanted = os.environ.get(VARIANT_ENV)
    if not wanted:
        return runnable
    chosen = tuple(v for v in runnable if v.isa == wanted)
    if not chosen:
        logger.warning("%s=%s: not a variant this CPU runs (%s); choosing among those", VARIANT_ENV, wanted,
                       ", ".join(v.isa for v in runnable))
    return chosen or runnable


def _built_with_package() -> KernelsBuild | None:
    """The best variant among those built with the package (for these sources) that this CPU runs."""
    digest = builds.sources_digest()
    for variant in _candidates():
        name = f"{__package__}.{variant.module_name(digest)}"
        spec = importlib.util.find_spec(name)
        if spec is None:
            continue
        try:
            module = importlib.import_module(name)
        except ImportError as err:  # NOTE: typically built against another torch, whose symbols it misses
            logger.warning("CPU kernels: the %s build that came with kvforge does not load (%s); kvforge must be "
                           "built against the torch it runs with (setup.py)", variant.isa, err)
            continue
        return KernelsBuild(module, "built with the package", spec.origin)
    return None


def _compiled_on_first_use() -> KernelsBuild:
    """The kernels compiled for this CPU (-march=native) by torch, which caches the build for later processes."""
    # NOTE: the name holds a digest of the sources and of their folder: two checkouts never share (and rebuild over
    # each other) one build folder, nor load each other's module; torch rebuilds a module whose source paths changed,
    # even when their contents are the same.
    digest = hashlib.sha256(f"{CSRC} {builds.sources_digest()}".encode()).hexdigest()[:12]
    logger.info("CPU kernels: none came with kvforge for these sources (a source checkout?); compiling them for "
                "this CPU on first use (-march=native; 1-3 minutes, once: torch caches the build)")
    try:
        from torch.utils.cpp_extension import load

        module = load(name=f"kvforge_cpu_kernels_{digest}", sources=[str(s) for s in builds.sources()],
                      extra_cflags=[*builds.COMMON_FLAGS, "-march=native"], extra_ldflags=list(builds.LINK_FLAGS),
                      verbose=False)
    except (OSError, RuntimeError, ImportError) as err:
        logger.warning("CPU kernels unavailable: none came with kvforge for this CPU, and compiling them failed, so "
                       "the engine runs its torch fallbacks instead (attention, quantized matmuls, norms), several "
                       "times slower. Install a C++ compiler and ninja, or kvforge built with its kernels (setup.py). "
                       "%s", err)
        return KernelsBuild(None, f"none came with kvforge, and compiling them failed: {err}")
    return KernelsBuild(module, "compiled on first use for this CPU (-march=native)", module.__file__)


# The C entry points of csrc/c_shims.cpp, as Inductor's C++ wrapper declares them (the signatures there).
C_SHIMS = {
    "quant_gemm_panels": "AOTITorchError aoti_torch_cpu_quant_gemm_panels(AtenTensorHandle x, AtenTensorHandle weight, "
    "int64_t bits, int64_t out_features, double factor, AtenTensorHandle* out)",
    "paged_decode": "AOTITorchError aoti_torch_cpu_paged_decode(AtenTensorHandle query, AtenTensorHandle key_cache, "
    "AtenTensorHandle value_cache, AtenTensorHandle block_tables, AtenTensorHandle seq_lens, double scale, "
    "AtenTensorHandle* key_scale, AtenTensorHandle* value_scale, int64_t sliding_window, double softcap, "
    "AtenTensorHandle* sinks, AtenTensorHandle* out)",
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

    @torch.library.register_fake("kvforge_cpu::half_gemv")
    def _(x, weight, vector_bits=0):
        return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("kvforge_cpu::onednn_linear")
    def _(x, weight, bias):
        return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("kvforge_cpu::paged_decode")
    def _(query, key_cache, value_cache, block_tables, seq_lens, scale, key_scale=None, value_scale=None,
          sliding_window=0, softcap=0.0, sinks=None):
        return torch.empty_like(query)

    @torch.library.register_fake("kvforge_cpu::paged_prefill")
    def _(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, key_scale=None,
          value_scale=None, sliding_window=0, softcap=0.0, sinks=None):
        return torch.empty_like(query)

    @torch.library.register_fake("kvforge_cpu::varlen_attention")
    def _(query, key, value, query_start_loc, scale, causal):
        return torch.empty_like(query, memory_format=torch.contiguous_format)

    @torch.library.register_fake("kvforge_cpu::cache_write")
    def _(rows, cache, slot_mapping):
        return None

    @torch.library.register_fake("kvforge_cpu::lora_apply")
    def _(y, x, a, bt, slots):
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
