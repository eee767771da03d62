"""The builds of the C++ CPU kernels (csrc/): one per instruction set, each a Python extension module of its own,
and which of them this CPU runs.

setup.py builds them when the package is built (reading this file by its path, without importing kvforge: it needs
only the standard library); kernels/cpu/extension.py loads the best one this CPU runs, as ggml and PyTorch pick
their kernels from the CPU's flags at run time:

    variant       compiler target                    runs on (flags in /proc/cpuinfo)
    avx512-vnni   -march=x86-64-v4 -mavx512vnni      Cascade Lake, Ice Lake, Sapphire Rapids, Zen 4 and later
    avx2          -march=x86-64-v3 (AVX2, FMA, F16C) Haswell, Zen 1 and later
    portable      the compiler's default target      any CPU, the only variant built off x86-64

The sources pick their code with the compiler's macros (`__AVX512VNNI__`, `__AVX2__`, `__F16C__`): a variant
without a kernel's instructions keeps that kernel's fallback (the panel kernel needs AVX-512 VNNI, the vectorized
gemv AVX2), as `quant_gemv_isa()` reports. Each module's name carries a digest of the sources and flags it was built
from, so a build of other sources (a checkout whose kernels were edited since) is never loaded for these.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
# setup.py: which variants to build, comma-separated ISA names or "host" (the one this machine runs); default all
BUILD_VARIANTS_ENV = "KVFORGE_CPU_VARIANTS"
# NOTE: -fopenmp, or at::parallel_for (inlined from torch's headers) runs on one thread; the module then needs
# libgomp.so.1, which resolves to the copy torch has loaded. -g0 -fno-wrapv undo what Python's own CFLAGS, which
# setup.py's compiles start with, ask for: debug info (measured: paged_decode.cpp's compile 33 -> 22 s, its object
# 13 -> 0.7 MB) and wrapping signed arithmetic (the first-use build has neither).
COMMON_FLAGS = ("-O3", "-g0", "-fno-wrapv", "-fopenmp")
LINK_FLAGS = ("-fopenmp",)
X86_MACHINES = ("x86_64", "amd64")

# The flags of /proc/cpuinfo that each -march level lets the compiler use (x86-64 psABI levels v2, v3, v4).
_X86_64_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})
_X86_64_V3 = _X86_64_V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_X86_64_V4 = _X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True, slots=True)
class Variant:
    """One build of the kernels: its instruction set (what its `quant_gemv_isa()` reports), its compiler target
    flags, and the CPU flags those assume."""

    isa: str
    march_flags: tuple[str, ...]
    cpu_flags: frozenset[str]
    x86_only: bool = True

    def runs_on(self, flags: frozenset[str]) -> bool:
        return self.cpu_flags <= flags

    def module_name(self, sources_digest: str) -> str:
        """The extension module's name: the ISA and a digest of the sources and compiler flags it is built from."""
        flags = " ".join((*COMMON_FLAGS, *self.march_flags))
        digest = hashlib.sha256(f"{sources_digest} {flags}".encode()).hexdigest()[:12]
        return f"_kernels_{self.isa.replace('-', '_')}_{digest}"


VARIANTS = (  # best first
    # NOTE: 256-bit vectors where the compiler vectorizes loops itself (`omp simd` reductions), as GCC's tuning for
    # every Intel AVX-512 CPU has it, and so -march=native there: the same sums in the same order, so the same tokens
    # as the first-use build (measured: with 512-bit ones, the default model's greedy answer parted after 6 tokens).
    Variant("avx512-vnni", ("-march=x86-64-v4", "-mavx512vnni", "-mprefer-vector-width=256"),
            _X86_64_V4 | {"avx512_vnni"}),
    Variant("avx2", ("-march=x86-64-v3",), _X86_64_V3),
    Variant("portable", (), frozenset(), x86_only=False),
)


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (only those the kernel lets programs use); empty elsewhere,
    where only the portable variant is chosen."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")
    return frozenset(line.partition(":")[2].split())


def runnable(flags: frozenset[str], machine: str) -> tuple[Variant, ...]:
    """The variants a CPU of these flags runs, best first (the portable one last, always)."""
    x86 = machine.lower() in X86_MACHINES
    return tuple(v for v in VARIANTS if (x86 or not v.x86_only) and v.runs_on(flags))


def variants_to_build(requested: str, machine: str, flags: frozenset[str]) -> tuple[Variant, ...]:
    """What setup.py builds: every variant of the machine's architecture by default, or those named in `requested`
    (BUILD_VARIANTS_ENV: comma-separated ISA names, or "host" for the best this CPU runs)."""
    x86 = machine.lower() in X86_MACHINES
    buildable = tuple(v for v in VARIANTS if x86 or not v.x86_only)
    names = [name.strip() for name in requested.split(",") if name.strip()]
    if not names:
        return buildable
    by_isa = {v.isa: v for v in buildable}
    chosen = []
    for name in names:
        if name == "host":
            chosen.append(runnable(flags, machine)[0])
        elif name in by_isa:
            chosen.append(by_isa[name])
        else:
            raise ValueError(f"{BUILD_VARIANTS_ENV}: {name!r} is not a variant buildable on {machine}; "
                             f"choose among {', '.join(by_isa)} or host")
    return tuple(dict.fromkeys(chosen))


def sources() -> list[Path]:
    """The C++ files of every build (the headers they include sit beside them)."""
    return sorted(CSRC.glob("*.cpp"))


def sources_digest() -> str:
    """A digest of the sources' names and contents, headers included."""
    files = sorted(f for f in CSRC.iterdir() if f.suffix in (".cpp", ".h"))
    return hashlib.sha256(b"".join(f.name.encode() + b"\0" + f.read_bytes() for f in files)).hexdigest()[:16]
