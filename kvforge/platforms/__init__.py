"""Which device we run on (CPU, CUDA, ROCm), its arch and capabilities, and the kernel backend it gets."""

from kvforge.platforms.backend import KERNEL_BACKENDS, select_backend, triton_available
from kvforge.platforms.detect import (
    PLATFORM_KINDS,
    Platform,
    current_platform,
    detect_platform,
    launch_platform,
    pin_platform,
)
from kvforge.platforms.device_specs import DevicePeak, lookup_device_peak

__all__ = [
    "KERNEL_BACKENDS",
    "PLATFORM_KINDS",
    "DevicePeak",
    "Platform",
    "current_platform",
    "detect_platform",
    "launch_platform",
    "lookup_device_peak",
    "pin_platform",
    "select_backend",
    "triton_available",
]
