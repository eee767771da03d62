"""`kvforge env`: what the engine will use on this machine, one line each: kvforge and torch, the C++ CPU kernels
(which build and its file, or why there are none), the CPU's instruction set, Triton, the devices and the threads.

    kvforge      0.1.0 (/…/site-packages/kvforge)
    torch        2.13.0+cpu (CPU only)
    C++ kernels  avx512-vnni, built with the package (/…/kvforge/kernels/cpu/_kernels_avx512_vnni_….so)
    CPU ISA      avx512-vnni: this CPU runs the variants avx512-vnni, avx2, portable (x86_64; torch dispatches AVX512)
    Triton       3.9.0 (unused: kernels use the torch path here, no CUDA or ROCm device)
    devices      cpu: Intel(R) Xeon(R) Processor, 2 cores, 23.5 GiB
    threads      2 (torch intra-op)

In a source checkout without built kernels, the C++ kernels line compiles them first, as the engine would.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform as host
from pathlib import Path

import torch

import kvforge
from kvforge.kernels.cpu import builds
from kvforge.kernels.cpu.extension import kernels_build
from kvforge.platforms.backend import select_backend, triton_available
from kvforge.platforms.detect import current_platform


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no flags


def _torch() -> str:
    if torch.version.hip:
        return f"{torch.__version__} (ROCm {torch.version.hip})"
    if torch.version.cuda:
        return f"{torch.__version__} (CUDA {torch.version.cuda})"
    return f"{torch.__version__} (CPU only)"


def _cpu_isa() -> str:
    variants = builds.runnable(builds.cpu_flags(), host.machine())
    return (f"{variants[0].isa}: this CPU runs the variants {', '.join(v.isa for v in variants)} "
            f"({host.machine()}; torch dispatches {torch.backends.cpu.get_cpu_capability()})")


def _triton() -> str:
    if not triton_available():
        return "absent (GPU kernels would use the torch path)"
    version = importlib.metadata.version("triton")
    backend = select_backend()
    if backend == "triton":
        return f"{version} (the GPU kernels)"
    return f"{version} (unused: kernels use the torch path here, no CUDA or ROCm device)"


def _devices() -> str:
    device = current_platform()
    line = f"{device.kind}: {device.device_name}, {device.num_compute_units} "
    line += f"{'compute units' if device.is_gpu else 'cores'}, {device.total_memory_bytes / 2**30:.1f} GiB"
    if device.is_gpu:
        line += f" ({torch.cuda.device_count()} visible)"
    return line


def report() -> list[tuple[str, str]]:
    """(what, value) rows, as printed."""
    return [
        ("kvforge", f"{kvforge.__version__} ({Path(kvforge.__file__).parent})"),
        ("torch", _torch()),
        ("C++ kernels", kernels_build().describe()),
        ("CPU ISA", _cpu_isa()),
        ("Triton", _triton()),
        ("devices", _devices()),
        ("threads", f"{torch.get_num_threads()} (torch intra-op)"),
    ]


def run(args: argparse.Namespace) -> int:
    del args
    for what, value in report():
        print(f"{what:<12} {value}")
    return 0
