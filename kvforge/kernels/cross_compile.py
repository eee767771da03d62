"""`kvforge compile-kernels`: compile every Triton kernel for GPUs that are not in this machine.

Triton compiles for a named target without its device. Here the engine's own launchers run on CPU
tensors, under the pinned platform of the target (so they pick its tuning-table tiles and split counts)
and a compile-only Triton driver whose launches do nothing. Each kernel is therefore compiled exactly as
the engine would launch it there, and checked the way Triton checks it at load time (shared memory or
LDS against the device's limit), plus registers and spills read from the compiled code.

NOTE: compiling needs a process where triton was imported with TRITON_INTERPRET=0, so the command runs
itself again in one when this process has the interpreter. The driver interface it stands in for is the
one Triton 3.6-3.9 call from JITFunction and CompiledKernel.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvforge.platforms import Platform, lookup_device_peak, pin_platform


@dataclass(frozen=True, slots=True)
class Target:
    """A GPU to compile for: what Triton needs (backend, arch, warp size) and what the launchers and the
    load-time checks read (compute units, shared memory per block)."""

    arch: str
    device_name: str
    num_compute_units: int
    shared_memory_bytes: int  # the most one block may use: Triton's max_shared_mem
    memory_gib: int

    @property
    def backend(self) -> str:
        return "cuda" if self.arch.startswith("sm_") else "hip"

    @property
    def warp_size(self) -> int:
        return 64 if self.arch.startswith("gfx9") else 32

    def platform(self) -> Platform:
        return Platform(
            kind="cuda" if self.backend == "cuda" else "rocm",
            device_name=self.device_name,
            arch=self.arch,
            warp_size=self.warp_size,
            num_compute_units=self.num_compute_units,
            total_memory_bytes=self.memory_gib << 30,
            peak=lookup_device_peak(self.device_name),
        )


TARGETS = {
    t.arch: t
    for t in (
        Target("sm_80", "NVIDIA A100-SXM4-80GB", 108, 166912, 80),
        Target("sm_89", "NVIDIA L40S", 142, 101376, 48),
        Target("sm_90", "NVIDIA H200", 132, 232448, 141),
        Target("sm_100", "NVIDIA B200", 148, 232448, 180),
        Target("gfx90a", "AMD Instinct MI250X", 110, 65536, 64),  # one of its two dies
        Target("gfx942", "AMD Instinct MI300X", 304, 65536, 192),
        Target("gfx950", "AMD Instinct MI355X", 256, 163840, 288),
        Target("gfx1100", "AMD Radeon RX 7900 XTX", 96, 65536, 24),
    )
}


@dataclass(slots=True)
class Compiled:
    """One kernel as compiled for one target (several per case: a case may launch several kernels)."""

    arch: str
    case: str
    kernel: str
    num_warps: int
    num_stages: int
    shared_bytes: int
    registers: int  # per thread: registers (NVIDIA) or VGPRs (AMD)
    spill_bytes: int  # spill stores (NVIDIA) or scratch (AMD) per thread; 0 when nothing spills
    compile_s: float  # the case's wall time, shared among the kernels it built (small on a cache hit)


@dataclass(slots=True)
class Failure:
    arch: str
    case: str
    error: str  # one line
    refused: bool  # the launcher refused the case on this target with a ValueError (by design)


class _CompileOnlyDriver:
    """Triton's active-driver interface for a target that is not here: compiles, never launches.

    launcher_cls and utils.load_binary are called once per compiled kernel, at its first launch, after
    Triton's own shared-memory check against utils.get_device_properties."""

    def __init__(self, target: Target) -> None:
        from triton.backends.compiler import GPUTarget

        arch = int(target.arch[3:]) if target.backend == "cuda" else target.arch
        self._target = GPUTarget(target.backend, arch, target.warp_size)
        self._properties = {
            "max_shared_mem": target.shared_memory_bytes,
            "multiprocessor_count": target.num_compute_units,
            "max_num_regs": 65536,
            "warpSize": target.warp_size,
        }
        self.utils = self

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_current_target(self):
        return self._target

    def get_device_properties(self, device: int) -> dict:
        return self._properties

    def load_binary(self, name, binary, shared, device):
        return None, None, 0, 0, 1024  # module, function, registers, spills, max threads per block

    def unload_module(self, module) -> None:
        pass

    def launcher_cls(self, src, metadata) -> Callable[..., None]:
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def _compiling_for(target: Target, kernels: list) -> Iterator[_CompileOnlyDriver]:
    """Launches of the kernels compile for target. NOTE: a JITFunction keeps its compiled kernels and
    its target per device index (device_caches), so they are dropped on the way in and out."""
    from triton.compiler.compiler import max_shared_mem
    from triton.runtime.driver import driver as triton_driver

    for fn in kernels:
        fn.device_caches.clear()
    max_shared_mem.cache_clear()  # cached per device index, whatever the driver
    fake = _CompileOnlyDriver(target)
    previous = getattr(triton_driver, "_active", None)  # None: no device here, none was created
    triton_driver.set_active(fake)
    try:
        with pin_platform(target.platform()):
            yield fake
    finally:
        triton_driver.set_active(previous)
        max_shared_mem.cache_clear()
        for fn in kernels:
            fn.device_caches.clear()


def _cuda_resources(ptx: str) -> tuple[int, int]:
    """(registers, spill-store bytes) per thread: the kernel's PTX through the ptxas that ships with
    Triton, as Triton runs it (the blackwell build for sm_90 and later, as Triton 3.6+ picks it)."""
    import triton

    target = re.search(r"^\.target\s+(sm_\w+)", ptx, re.MULTILINE).group(1)
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    ptxas = tools / ("ptxas-blackwell" if int(re.sub(r"\D", "", target)) >= 90 else "ptxas")
    if not ptxas.exists():
        ptxas = tools / "ptxas"
    with tempfile.NamedTemporaryFile(suffix=".ptx", mode="w") as file:
        file.write(ptx)
        file.flush()
        log = subprocess.run([str(ptxas), "-v", f"--gpu-name={target}", file.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr  # fmt: skip
    registers = re.search(r"Used (\d+) registers", log).group(1)
    return int(registers), int(re.search(r"(\d+) bytes spill stores", log).group(1))


def _amd_resources(amdgcn: str) -> tuple[int, int]:
    """(VGPRs, scratch bytes) per thread from the kernel's AMDGPU assembly comments (VGPRs include the
    accumulation registers of CDNA's matrix cores where the assembler counts them)."""
    vgprs = re.search(r";\s*TotalNumVgprs:\s*(\d+)", amdgcn) or re.search(r";\s*NumVgprs:\s*(\d+)", amdgcn)
    scratch = re.search(r";\s*ScratchSize:\s*(\d+)", amdgcn)
    return int(vgprs.group(1)), int(scratch.group(1))


def _compiled_kernels(kernels: list) -> Iterator:
    """Every CompiledKernel the given JITFunctions hold for device 0."""
    for fn in kernels:
        if 0 in fn.device_caches:
            yield from fn.device_caches[0][0].values()


def _describe(target: Target, case: str, compiled, seconds: float) -> Compiled:
    if target.backend == "cuda":
        registers, spills = _cuda_resources(compiled.asm["ptx"])
    else:
        registers, spills = _amd_resources(compiled.asm["amdgcn"])
    meta = compiled.metadata
    return Compiled(target.arch, case, compiled.name, meta.num_warps, meta.num_stages, meta.shared, registers,
                    spills, round(seconds, 2))  # fmt: skip


# --- the cases: what the engine launches, at model-like sizes (contents never read: launches do nothing)


def _attention(head_dim: int, num_heads: int, num_kv_heads: int, block_size: int, dtype: torch.dtype,
               kv: str, decode_only: bool) -> None:  # fmt: skip
    from kvforge.kernels.kv_quant import kv_code_dtype
    from kvforge.kernels.paged_attention import paged_attention_triton

    q_lens = [1] * 4 if decode_only else [1, 1, 300, 77]
    seq_lens = [4000, 33, 812, 77]
    code = kv_code_dtype(kv)
    blocks = sum(-(-n // block_size) for n in seq_lens) + 1
    cache = torch.empty(blocks, block_size, num_kv_heads, head_dim, dtype=code or dtype)
    scales = torch.ones(blocks, block_size, num_kv_heads) if code is not None else None
    tables = torch.zeros(len(seq_lens), -(-max(seq_lens) // block_size), dtype=torch.int32)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.empty(sum(q_lens), num_heads, head_dim, dtype=dtype)
    paged_attention_triton(query, cache, cache, tables, starts, torch.tensor(seq_lens, dtype=torch.int32),
                           head_dim**-0.5, scales, scales)  # fmt: skip


def _cache_write(kv: str, dtype: torch.dtype) -> None:
    from kvforge.kernels.cache_write import reshape_and_cache_triton
    from kvforge.kernels.kv_quant import kv_code_dtype

    code = kv_code_dtype(kv)
    key = torch.empty(64, 8, 128, dtype=dtype)
    cache = torch.empty(16, 16, 8, 128, dtype=code or dtype)
    scales = torch.ones(16, 16, 8) if code is not None else None
    reshape_and_cache_triton(key, key, cache, cache, torch.arange(64), scales, scales)


def _row_ops(hidden: int, dtype: torch.dtype) -> None:
    from kvforge.kernels.activation import silu_and_mul_triton
    from kvforge.kernels.rms_norm import fused_add_rms_norm_triton, rms_norm_triton

    x = torch.empty(8, hidden, dtype=dtype)
    rms_norm_triton(x, torch.empty(hidden, dtype=dtype), 1e-6)
    fused_add_rms_norm_triton(x, x, torch.empty(hidden, dtype=dtype), 1e-6)
    silu_and_mul_triton(torch.empty(8, 2 * 14336, dtype=dtype))


def _rotary(head_dim: int, is_neox: bool, dtype: torch.dtype) -> None:
    from kvforge.kernels.rotary import rotary_embedding_triton

    query, key = torch.empty(8, 32, head_dim, dtype=dtype), torch.empty(8, 8, head_dim, dtype=dtype)
    rotary_embedding_triton(torch.arange(8), query, key, torch.empty(4096, head_dim), is_neox)


def _quant_gemm(bits: int, num_tokens: int, dtype: torch.dtype) -> None:
    from kvforge.kernels.quant_gemm import quant_gemm_triton

    n, k, group = 4096, 4096, 128
    scales = torch.empty(n, k // group, dtype=dtype)
    qweight = torch.empty(n, k * bits // 8, dtype=torch.uint8)
    quant_gemm_triton(torch.empty(num_tokens, k, dtype=dtype), qweight, scales, scales, bits)


def _int8_gemm(num_tokens: int) -> None:
    from kvforge.kernels.int8_gemm import int8_gemm_triton

    a, b = torch.empty(num_tokens, 4096, dtype=torch.int8), torch.empty(4096, 4096, dtype=torch.int8)
    int8_gemm_triton(a, b, torch.ones(num_tokens), torch.ones(4096), torch.bfloat16)


def _fused_moe(num_tokens: int) -> None:
    from kvforge.kernels.fused_moe import fused_moe_triton

    experts, hidden, inter, top_k = 8, 1024, 768, 2
    topk_ids = torch.arange(num_tokens * top_k).remainder(experts).view(num_tokens, top_k)
    fused_moe_triton(torch.empty(num_tokens, hidden, dtype=torch.bfloat16),
                     torch.empty(experts, 2 * inter, hidden, dtype=torch.bfloat16),
                     torch.empty(experts, hidden, inter, dtype=torch.bfloat16),
                     torch.ones(num_tokens, top_k), topk_ids)  # fmt: skip


def _mla_decode(num_seqs: int) -> None:
    from kvforge.kernels.mla_decode import mla_decode_triton

    latent, rope, heads, block_size = 512, 64, 16, 64
    cache = torch.empty(num_seqs * 8 + 1, block_size, latent + rope, dtype=torch.bfloat16)
    tables = torch.zeros(num_seqs, 8, dtype=torch.int32)
    mla_decode_triton(torch.empty(num_seqs, heads, latent + rope, dtype=torch.bfloat16), cache, tables,
                      torch.full((num_seqs,), 500, dtype=torch.int32), 0.1, latent)  # fmt: skip


def cases() -> dict[str, Callable[[], None]]:
    """Every launch configuration the engine uses, by name."""
    bf16, fp16 = torch.bfloat16, torch.float16
    found: dict[str, Callable[[], None]] = {}
    for head_dim, dtype in ((64, bf16), (80, bf16), (128, bf16), (128, fp16), (256, bf16)):
        name = f"attention hd{head_dim} {str(dtype)[6:]}"
        found[name] = lambda d=head_dim, t=dtype: _attention(d, 32, 8, 16, t, "auto", False)
    found["attention hd128 MQA block32"] = lambda: _attention(128, 32, 1, 32, bf16, "auto", False)
    found["attention hd128 MHA decodes only"] = lambda: _attention(128, 32, 32, 16, bf16, "auto", True)
    for kv in ("int8", "fp8"):
        found[f"attention hd128 {kv} KV"] = lambda kv=kv: _attention(128, 32, 8, 16, bf16, kv, False)
        found[f"cache write {kv} KV"] = lambda kv=kv: _cache_write(kv, bf16)
    found["cache write"] = lambda: _cache_write("auto", bf16)
    for hidden in (576, 4096, 8192):
        found[f"norms+silu hidden {hidden}"] = lambda h=hidden: _row_ops(h, bf16)
    for head_dim, is_neox in ((128, True), (64, False)):
        found[f"rotary hd{head_dim} {'neox' if is_neox else 'gptj'}"] = lambda d=head_dim, n=is_neox: _rotary(
            d, n, bf16
        )
    for bits in (4, 8):
        for tokens in (1, 256):
            found[f"w{bits}a16 gemm M={tokens}"] = lambda b=bits, m=tokens: _quant_gemm(b, m, fp16)
    for tokens in (1, 256):
        found[f"w8a8 gemm M={tokens}"] = lambda m=tokens: _int8_gemm(m)
        found[f"fused moe {tokens} tokens"] = lambda m=tokens: _fused_moe(m)
    for num_seqs in (1, 64):
        found[f"mla decode {num_seqs} seqs"] = lambda n=num_seqs: _mla_decode(n)
    return found


def _jit_functions() -> list:
    """Every Triton kernel of the package (the JITFunctions defined in kvforge.kernels' modules)."""
    import importlib
    import pkgutil

    import triton

    import kvforge.kernels as package

    found = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"kvforge.kernels.{info.name}")
        found += [v for v in vars(module).values() if isinstance(v, triton.runtime.JITFunction) and v not in found]
    return found


def compile_for(target: Target, selected: dict[str, Callable[[], None]]) -> list[Compiled | Failure]:
    """Run each case's launches for target; what each compiled, or why it did not."""
    from triton.runtime.errors import OutOfResources

    kernels = _jit_functions()
    results: list[Compiled | Failure] = []
    seen: set[str] = set()
    with _compiling_for(target, kernels):
        for case, launch in selected.items():
            start = time.perf_counter()
            try:
                launch()
            except ValueError as err:
                results.append(Failure(target.arch, case, str(err).splitlines()[0], refused=True))
                continue
            except OutOfResources as err:
                results.append(Failure(target.arch, case, str(err).splitlines()[0], refused=False))
                continue
            except Exception as err:  # a compile error: report it with the others
                message = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
                results.append(Failure(target.arch, case, f"{type(err).__name__}: {message}", refused=False))
                continue
            seconds = time.perf_counter() - start
            new = [k for k in _compiled_kernels(kernels) if k.hash not in seen]
            for compiled in new:
                seen.add(compiled.hash)
                results.append(_describe(target, case, compiled, seconds / len(new)))
    return results


def format_table(results: list[Compiled | Failure]) -> str:
    header = (f"{'arch':<8}{'case':<38}{'kernel':<26}{'warps':>6}{'stages':>7}{'shared KiB':>11}{'regs':>6}"
              f"{'spill B':>8}{'s':>6}")  # fmt: skip
    lines = [header, "-" * len(header)]
    for r in results:
        if isinstance(r, Compiled):
            lines.append(
                f"{r.arch:<8}{r.case:<38}{r.kernel:<26}{r.num_warps:>6}{r.num_stages:>7}"
                f"{r.shared_bytes / 1024:>11.1f}{r.registers:>6}{r.spill_bytes:>8}{r.compile_s:>6.1f}"
            )
        else:
            lines.append(f"{r.arch:<8}{r.case:<38}{'REFUSED' if r.refused else 'FAILED'}: {r.error}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", nargs="+", default=list(TARGETS), metavar="ARCH",
                        help=f"architectures to compile for (default: all of {', '.join(TARGETS)})")  # fmt: skip
    parser.add_argument("--cases", default=None, help="comma-separated substrings: only cases whose name has one")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    parser.add_argument("--list", action="store_true", help="print the case names and exit")


def run(args: argparse.Namespace) -> int:
    unknown = [arch for arch in args.arch if arch not in TARGETS]
    if unknown:
        raise ValueError(f"--arch must be among {tuple(TARGETS)}, got {unknown}")
    selected = cases()
    if args.cases is not None:
        wanted = [w.strip() for w in args.cases.split(",") if w.strip()]
        selected = {name: fn for name, fn in selected.items() if any(w in name for w in wanted)}
        if not selected:
            raise ValueError(f"--cases {args.cases!r} matches no case (see --list)")
    if args.list:
        print("\n".join(selected))
        return 0
    from kvforge.kernels.triton_compat import INTERPRETED, require_triton

    require_triton()
    if INTERPRETED:  # triton was imported for the interpreter: compile in a fresh process
        argv = ["--arch", *args.arch, *(["--cases", args.cases] if args.cases is not None else []),
                *(["--json", str(args.json)] if args.json is not None else [])]  # fmt: skip
        # NOTE: fp fusion on, as Triton <= 3.9 does by default (set, it also silences 3.9's warning).
        env = {"TRITON_DEFAULT_FP_FUSION": "1", **os.environ, "TRITON_INTERPRET": "0"}
        return subprocess.run([sys.executable, "-m", "kvforge.kernels.cross_compile", *argv], env=env).returncode
    results = [r for arch in args.arch for r in compile_for(TARGETS[arch], selected)]
    print(format_table(results))
    if args.json is not None:
        args.json.write_text(json.dumps([{"type": type(r).__name__, **asdict(r)} for r in results], indent=1))
    failed = [r for r in results if isinstance(r, Failure) and not r.refused]
    refused = [r for r in results if isinstance(r, Failure) and r.refused]
    builds = len(results) - len(failed) - len(refused)
    print(f"{builds} kernel builds; cases: {len(refused)} refused by design, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="kvforge compile-kernels", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
