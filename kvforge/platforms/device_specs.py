"""Datasheet peak figures for the accelerators we know, used to place kernel timings on a roofline.

Figures are dense (no structured sparsity), for the SXM/OAM variant unless the name says PCIe.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DevicePeak:
    """Peak throughput of one device: memory bandwidth and dense matrix math."""

    memory_bandwidth_gbs: float  # GB/s (1e9 bytes per second)
    bf16_tflops: float  # dense bf16 tensor-core / matrix-core TFLOP/s
    fp32_tflops: float  # fp32 TFLOP/s without TF32 tricks

    def __post_init__(self) -> None:
        for name in ("memory_bandwidth_gbs", "bf16_tflops", "fp32_tflops"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"DevicePeak.{name} must be > 0, got {value}")


# NOTE: first match wins, so a more specific name ("H100 PCIe", "MI250X") precedes a general one.
_KNOWN_DEVICES: tuple[tuple[str, DevicePeak], ...] = (
    ("B200", DevicePeak(8000.0, 2250.0, 75.0)),
    ("H200", DevicePeak(4800.0, 989.0, 67.0)),
    ("H100 PCIe", DevicePeak(2000.0, 756.0, 51.0)),
    ("H100 NVL", DevicePeak(3900.0, 835.0, 60.0)),
    ("H100", DevicePeak(3350.0, 989.0, 67.0)),
    ("A100-SXM4-40GB", DevicePeak(1555.0, 312.0, 19.5)),
    ("A100-PCIE-40GB", DevicePeak(1555.0, 312.0, 19.5)),
    ("A100 80GB PCIe", DevicePeak(1935.0, 312.0, 19.5)),
    ("A100", DevicePeak(2039.0, 312.0, 19.5)),
    ("L40S", DevicePeak(864.0, 362.0, 91.6)),
    ("L40", DevicePeak(864.0, 181.0, 90.5)),
    ("A10", DevicePeak(600.0, 125.0, 31.2)),
    ("L4", DevicePeak(300.0, 121.0, 30.3)),
    ("MI325X", DevicePeak(6000.0, 1307.0, 163.4)),
    ("MI300X", DevicePeak(5300.0, 1307.0, 163.4)),
    ("MI250X", DevicePeak(3277.0, 383.0, 47.9)),
    ("MI250", DevicePeak(3277.0, 362.0, 45.3)),
    ("MI210", DevicePeak(1638.0, 181.0, 22.6)),
)


def lookup_device_peak(device_name: str) -> DevicePeak | None:
    """The datasheet figures of a device from its marketing name (as torch reports it), or None."""
    for fragment, peak in _KNOWN_DEVICES:
        if fragment.lower() in device_name.lower():
            return peak
    return None
