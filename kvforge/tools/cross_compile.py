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
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from kvforge.tools.compile_driver import Compiled, Failure, compiled_kernels, compiling_for, describe, jit_functions
from kvforge.tools.compile_targets import TARGETS, Target
from kvforge.tools.kernel_cases import cases


def compile_for(target: Target, selected: dict[str, Callable[[], None]]) -> list[Compiled | Failure]:
    """Run each case's launches for target; what each compiled, or why it did not."""
    from triton.runtime.errors import OutOfResources

    kernels = jit_functions()
    results: list[Compiled | Failure] = []
    seen: set[str] = set()
    with compiling_for(target, kernels):
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
            new = [k for k in compiled_kernels(kernels) if k.hash not in seen]
            for compiled in new:
                seen.add(compiled.hash)
                results.append(describe(target, case, compiled, seconds / len(new)))
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
        return subprocess.run([sys.executable, "-m", "kvforge.tools.cross_compile", *argv], env=env).returncode
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
