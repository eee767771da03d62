"""Which device we run on: CPU, an NVIDIA GPU (CUDA) or an AMD GPU (ROCm/HIP), and what it can do."""

from __future__ import annotations

import contextlib
import functools
import os
import platform as host
from dataclasses import dataclass

import torch

from kvforge.platforms.device_specs import DevicePeak, lookup_device_peak

PLATFORM_KINDS = ("cpu", "cuda", "rocm")


@dataclass(frozen=True, slots=True)
class Platform:
    """The device the engine runs on, as far as kernels and benchmarks care."""

    kind: str  # one of PLATFORM_KINDS
    device_name: str  # "NVIDIA H200", "AMD Instinct MI300X", or the CPU model
    arch: str  # "sm_90", "gfx942", ... or the CPU machine type ("x86_64")
    warp_size: int  # threads per warp (32) or wavefront (64 on CDNA, 32 on RDNA); 1 on the CPU
    num_compute_units: int  # SMs, CUs, or CPU cores
    total_memory_bytes: int
    peak: DevicePeak | None  # datasheet figures when the device is known

    def __post_init__(self) -> None:
        if self.kind not in PLATFORM_KINDS:
            raise ValueError(f"Platform.kind must be one of {PLATFORM_KINDS}, got {self.kind!r}")
        if self.warp_size < 1 or self.num_compute_units < 1:
            raise ValueError(
                f"Platform needs warp_size >= 1 and num_compute_units >= 1, "
                f"got {self.warp_size} and {self.num_compute_units}"
            )

    @property
    def is_gpu(self) -> bool:
        return self.kind != "cpu"

    @property
    def has_native_fp8(self) -> bool:
        """Whether the GPU converts and multiplies float8 e4m3 (fp8_dtype) in hardware: NVIDIA sm_89+ and
        AMD gfx942/gfx950 (MI300, MI350) and gfx12 (RDNA4). Elsewhere (the CPU too) fp8 is storage only."""
        if self.kind == "cuda":
            version = self.arch.removeprefix("sm_")
            return version.isdigit() and int(version) >= 89
        return self.kind == "rocm" and (self.arch in ("gfx942", "gfx950") or self.arch.startswith("gfx12"))

    @property
    def fp8_dtype(self) -> torch.dtype:
        """The device's float8 e4m3: the "fnuz" variant on the AMD MI300 (gfx942: exponent bias 8, no
        negative zero, so the same bits stand for half the value), the OCP e4m3fn everywhere else."""
        return torch.float8_e4m3fnuz if self.kind == "rocm" and self.arch == "gfx942" else torch.float8_e4m3fn

    @property
    def launch_key(self) -> str:
        """What a kernel launch reads of the platform (its kind, the arch that picks the tuning table, the warp size
        and the compute units) as one string, the form a custom op's schema carries: `launch_platform` reads it
        back."""
        return f"{self.kind}/{self.arch}/{self.warp_size}/{self.num_compute_units}"

    @property
    def device_type(self) -> str:
        """The torch device type: ROCm devices are addressed as "cuda" too."""
        return "cuda" if self.is_gpu else "cpu"


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX
        return 0


def _cpu_platform() -> Platform:
    return Platform(
        kind="cpu",
        device_name=host.processor() or host.machine() or "cpu",
        arch=host.machine() or "cpu",
        warp_size=1,
        num_compute_units=os.cpu_count() or 1,
        total_memory_bytes=_host_memory_bytes(),
        peak=None,
    )


def _gpu_arch_and_warp(props: object, device_index: int) -> tuple[str, str, int]:
    """(kind, arch, warp size) of a visible GPU."""
    if torch.version.hip:
        arch = str(props.gcnArchName).split(":")[0]  # "gfx942:sramecc+:xnack-" -> "gfx942"
        # NOTE: CDNA (gfx9xx: MI100..MI300) runs 64-wide wavefronts; RDNA (gfx10+) runs 32-wide.
        default_warp = 64 if arch.startswith("gfx9") else 32
        return "rocm", arch, int(getattr(props, "warp_size", default_warp))
    major, minor = torch.cuda.get_device_capability(device_index)
    return "cuda", f"sm_{major}{minor}", int(getattr(props, "warp_size", 32))


def detect_platform(device_index: int = 0) -> Platform:
    """Probe torch for the device at device_index (uncached; see current_platform)."""
    if not torch.cuda.is_available():
        return _cpu_platform()
    if not 0 <= device_index < torch.cuda.device_count():
        raise ValueError(f"device_index must be in [0, {torch.cuda.device_count()}), got {device_index}")
    props = torch.cuda.get_device_properties(device_index)
    kind, arch, warp_size = _gpu_arch_and_warp(props, device_index)
    name = torch.cuda.get_device_name(device_index)
    return Platform(
        kind=kind,
        device_name=name,
        arch=arch,
        warp_size=warp_size,
        num_compute_units=int(props.multi_processor_count),
        total_memory_bytes=int(props.total_memory),
        peak=lookup_device_peak(name),
    )


@functools.cache
def _detected_platform() -> Platform:
    return detect_platform(0)


@functools.cache
def launch_platform(key: str) -> Platform | None:
    """The platform of a Platform.launch_key (its device name the arch; no memory or peak figures: a launch reads
    neither); None for "", a launch with no platform given (the current one's)."""
    if not key:
        return None
    kind, arch, warp_size, num_compute_units = key.split("/")
    return Platform(kind, arch, arch, int(warp_size), int(num_compute_units), 0, None)


_pinned: list[Platform] = []


def current_platform() -> Platform:
    """The platform of device 0, detected once per process, or the innermost one pinned by pin_platform."""
    return _pinned[-1] if _pinned else _detected_platform()


@contextlib.contextmanager
def pin_platform(platform: Platform):
    """Within the block current_platform() is platform, so kernels take that device's tiles: this is how
    kernels are compiled for a GPU that is not in this machine (kvforge.tools.cross_compile)."""
    _pinned.append(platform)
    try:
        yield platform
    finally:
        _pinned.pop()
