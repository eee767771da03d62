"""A compile-only Triton driver: launches on CPU tensors compile for a GPU that is not here, run nothing.

NOTE: the driver interface it stands in for is the one Triton 3.6-3.9 call from JITFunction and
CompiledKernel. Registers and spills are read from the compiled code (ptxas for NVIDIA, the AMDGPU
assembly's comments for AMD).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvforge.platforms import pin_platform
from kvforge.tools.compile_targets import Target


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
def compiling_for(target: Target, kernels: list) -> Iterator[_CompileOnlyDriver]:
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


def compiled_kernels(kernels: list) -> Iterator:
    """Every CompiledKernel the given JITFunctions hold for device 0."""
    for fn in kernels:
        if 0 in fn.device_caches:
            yield from fn.device_caches[0][0].values()


def describe(target: Target, case: str, compiled, seconds: float) -> Compiled:
    if target.backend == "cuda":
        registers, spills = _cuda_resources(compiled.asm["ptx"])
    else:
        registers, spills = _amd_resources(compiled.asm["amdgcn"])
    meta = compiled.metadata
    return Compiled(target.arch, case, compiled.name, meta.num_warps, meta.num_stages, meta.shared, registers,
                    spills, round(seconds, 2))  # fmt: skip


def jit_functions() -> list:
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
