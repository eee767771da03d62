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
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__:
    from kvforge.kernels.cpu import bindings
else:  # NOTE: setup.py reads this file by its path, without importing kvforge (the whole engine): bindings too
    _spec = importlib.util.spec_from_file_location("kvforge_cpu_bindings", Path(__file__).parent / "bindings.py")
    bindings = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = bindings  # NOTE: dataclasses look their module up there
    _spec.loader.exec_module(bindings)

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


def sources(generated: Path) -> list[Path]:
    """The C++ files of every build: csrc/'s (the headers they include sit beside them) and the generated
    bindings.cpp in `generated` (write_generated())."""
    return [*sorted(CSRC.glob("*.cpp")), generated / "bindings.cpp"]


def sources_digest() -> str:
    """A digest of the sources' names and contents, headers and generated files included."""
    files = sorted(f for f in CSRC.iterdir() if f.suffix in (".cpp", ".h"))
    texts = [(f.name, f.read_bytes()) for f in files] + [(n, t.encode()) for n, t in generated_sources().items()]
    return hashlib.sha256(b"".join(name.encode() + b"\0" + text for name, text in texts)).hexdigest()[:16]


def write_generated(folder: Path) -> Path:
    """Writes generated_sources() into `folder` (made if missing), each file only where its text changed (a build
    of unchanged sources then compiles nothing again); returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in generated_sources().items():
        path = folder / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    return folder


# The C++ type of each schema type, as an argument and as a result (Tensor(a!), a mutated tensor, is a Tensor).
CPP_TYPES = {"Tensor": "at::Tensor", "Tensor?": "std::optional<at::Tensor>", "Tensor[]": "std::vector<at::Tensor>",
             "int": "int64_t", "float": "double", "bool": "bool", "str": "std::string", "()": "void"}
# Each argument type a C entry point takes, and how its parameter becomes the kernel's argument.
_SHIM_ARGS = {"Tensor": ("AtenTensorHandle {}", "tensor({})"),
              "Tensor?": ("AtenTensorHandle* {}", "pointer_to_optional<at::Tensor>({})"),
              "int": ("int64_t {}", "{}"), "float": ("double {}", "{}")}


@dataclass(frozen=True, slots=True)
class Schema:
    """An op's schema taken apart: its arguments as (type, name) and its results' types."""

    name: str
    arguments: tuple[tuple[str, str], ...]
    results: tuple[str, ...]

    @classmethod
    def parse(cls, schema: str) -> Schema:
        name, _, rest = schema.partition("(")
        arguments, _, results = rest.rpartition(") -> ")
        args = []
        for argument in filter(None, (a.strip() for a in arguments.split(","))):
            kind, _, arg_name = argument.partition("=")[0].rpartition(" ")
            args.append(("Tensor" if kind.startswith("Tensor(") else kind, arg_name))
        results = results.strip()
        if results.startswith("("):
            results = results[1:-1]
        return cls(name, tuple(args), tuple(r.strip() for r in results.split(",") if r.strip()))

    def cpp_declaration(self) -> str:
        types = [CPP_TYPES[r] for r in self.results]
        result = "void" if not types else types[0] if len(types) == 1 else f"std::tuple<{', '.join(types)}>"
        return f"{result} {self.name}({', '.join(f'{CPP_TYPES[t]} {n}' for t, n in self.arguments)})"

    def shim_declaration(self) -> str:
        """The C entry point's declaration, as Inductor's C++ wrapper declares it: tensors by handle, optional
        tensors by a pointer to a handle (nullptr: None), and last the result, through a pointer to a new handle
        (nullptr where the op returns nothing)."""
        unsupported = [t for t, _ in self.arguments if t not in _SHIM_ARGS] + [r for r in self.results if r != "Tensor"]
        if unsupported or len(self.results) > 1:
            raise ValueError(f"{self.name}: a C entry point takes only {', '.join(_SHIM_ARGS)} arguments and returns "
                             f"one Tensor or nothing, not {', '.join(unsupported) or self.results}")
        params = [_SHIM_ARGS[t][0].format(n) for t, n in self.arguments]
        params.append("AtenTensorHandle* result" if self.results else "AtenTensorHandle* /*no_result*/")
        return f"AOTITorchError aoti_torch_cpu_{self.name}({', '.join(params)})"

    def shim_definition(self) -> str:
        call = f"kvforge_cpu::{self.name}({', '.join(_SHIM_ARGS[t][1].format(n) for t, n in self.arguments)})"
        body = f"*result = new_tensor_handle({call});" if self.results else f"{call};"
        return f"{self.shim_declaration()} {{\n  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({{ {body} }});\n}}\n"


_GENERATED = "// Generated by kvforge/kernels/cpu/builds.py from bindings.py, the ops' declarations: edit those.\n"


def generated_sources() -> dict[str, str]:
    """{file name: text} of the generated sources: ops.h and bindings.cpp (the module's doc)."""
    ops = [(op, Schema.parse(op.schema)) for op in bindings.OPS]
    header = "\n".join([
        _GENERATED + "// The C++ declarations of the ops' kernels, each defined in a csrc/ file as "
        "kvforge_cpu::<name>.",
        "#pragma once\n", "#include <ATen/ATen.h>\n", "#include <optional>\n#include <string>\n#include <tuple>",
        "#include <vector>\n", "namespace kvforge_cpu {\n", *(f"{s.cpp_declaration()};" for _, s in ops),
        "\n}  // namespace kvforge_cpu\n"])
    plain = [s for _, s in ops if not any(t.startswith("Tensor") for t, _ in s.arguments)]
    defs = [f'  m.def("{op.schema}", &kvforge_cpu::{s.name});' if s in plain else f'  m.def("{op.schema}");'
            for op, s in ops]
    impls = []
    for key in dict.fromkeys(k for op, s in ops if s not in plain for k in op.dispatch):
        served = [s for op, s in ops if s not in plain and key in op.dispatch]
        lines = [f'  m.impl("{s.name}", &kvforge_cpu::{s.name});' for s in served]
        impls.append(f"TORCH_LIBRARY_IMPL({bindings.NAMESPACE}, {key}, m) {{\n" + "\n".join(lines) + "\n}\n")
    registrations = "\n".join([
        _GENERATED + "// The ops' definitions and registrations (torch.ops.kvforge_cpu.*), and the C entry points that"
        " Inductor's\n// C++ wrapper calls instead of the dispatcher (bindings.py: c_shim).",
        "#include <torch/csrc/inductor/aoti_torch/utils.h>\n#include <torch/library.h>\n", '#include "ops.h"\n',
        f"TORCH_LIBRARY({bindings.NAMESPACE}, m) {{", *defs, "}\n", *impls,
        "using torch::aot_inductor::new_tensor_handle;\nusing torch::aot_inductor::pointer_to_optional;\n",
        "namespace {\n", "const at::Tensor& tensor(AtenTensorHandle handle) {",
        "  return *torch::aot_inductor::tensor_handle_to_tensor_pointer(handle);\n}\n", "}  // namespace\n",
        'extern "C" {\n', *(s.shim_definition() for op, s in ops if op.c_shim), '}  // extern "C"\n'])
    return {"ops.h": header, "bindings.cpp": registrations}
