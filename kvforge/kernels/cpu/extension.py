"""The C++ CPU kernels (csrc/): the build of them that this CPU runs best, loaded once per process.

A kvforge package comes with its kernels compiled, one build per instruction set (builds.py, setup.py); the best one
this CPU's flags allow is loaded (`KVFORGE_CPU_VARIANT=avx2`, say, chooses a lesser one). Where none came with it for
these sources (a source checkout, or one whose kernels were edited since its build), they are compiled for this CPU
on first use (-march=native, 1-3 minutes once, then cached by torch), and the log says so.
Where that compile fails (no C++ compiler, no ninja), `cpu_kernels()` returns None and the callers keep their torch
paths, several times slower: a warning says so, and `kvforge env` shows what the engine uses.

The ops (`torch.ops.kvforge_cpu.*`, available once the module is loaded) are declared in bindings.py: their
schemas, the shapes of their results (registered here as their fake implementations, so that torch.compile traces
them as opaque nodes) and which have C entry points (c_shims(): the compiled single-stream step's C++ wrapper calls
those instead of the dispatcher). builds.py generates their C++ registrations from the same declarations.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace

from kvforge.kernels.cpu import bindings, builds

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
        # (bindings.py: c_shim) when they are loaded; Python loads extensions with their symbols local.
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
        from torch.utils.cpp_extension import get_default_build_root, load

        name = f"kvforge_cpu_kernels_{digest}"
        # NOTE: the generated sources (builds.py) beside torch's build folders, in one of their own per build
        root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
        generated = builds.write_generated(root / f"{name}_generated")
        module = load(name=name, sources=[str(s) for s in builds.sources(generated)],
                      extra_cflags=[*builds.COMMON_FLAGS, "-march=native"], extra_ldflags=list(builds.LINK_FLAGS),
                      extra_include_paths=[str(generated)], verbose=False)
    except (OSError, RuntimeError, ImportError) as err:
        logger.warning("CPU kernels unavailable: none came with kvforge for this CPU, and compiling them failed, so "
                       "the engine runs its torch fallbacks instead (attention, quantized matmuls, norms), several "
                       "times slower. Install a C++ compiler and ninja, or kvforge built with its kernels (setup.py). "
                       "%s", err)
        return KernelsBuild(None, f"none came with kvforge, and compiling them failed: {err}")
    return KernelsBuild(module, "compiled on first use for this CPU (-march=native)", module.__file__)


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
    wrapper then calls these ops directly instead of through the dispatcher (needs the extension loaded).

    NOTE: the dispatcher finds an op by name, boxes its arguments and dispatches at every call (211 calls a step of
    the default model). Single-stream decode of the default model, GGUF weights (`kvforge bench latency --input-len
    128 --output-len 128 --num-requests 3 --quantization gguf`), the same build with these declared to Inductor and
    without, four runs each in turns (Zen 4 EPYC VM, 2 threads): 186.1-187.4 -> 193.0-213.6 tokens/s, every run
    faster."""
    return {ShimmedOp(op.name): [builds.Schema.parse(op.schema).shim_declaration()]
            for op in bindings.OPS if op.c_shim}


def keep_python_memory() -> None:
    """What a CPU worker does at start: CPython's freed arenas and stack chunks are cached instead of unmapped
    (each munmap flushes the TLB of the process's OpenMP threads; csrc/python_arenas.cpp has the measurement)."""
    if cpu_kernels() is not None:
        import torch

        torch.ops.kvforge_cpu.cache_python_arenas()


def _register_fakes() -> None:
    """Each op's fake implementation (bindings.py: `outputs`), for tracing. Called once, after the library is
    loaded."""
    import torch

    for op in bindings.OPS:
        if op.outputs is not None:
            names = [name for _, name in builds.Schema.parse(op.schema).arguments]
            torch.library.register_fake(f"{bindings.NAMESPACE}::{op.name}")(_fake(op.outputs, names))


def _fake(outputs: Callable[[SimpleNamespace], object], names: list[str]) -> Callable[..., object]:
    """A fake implementation: the op's arguments, given as its schema orders them, by name to `outputs`."""
    return lambda *args, **kwargs: outputs(SimpleNamespace(**dict(zip(names, args)), **kwargs))
