"""The accelerators the planner knows: memory, bandwidth and compute of one device, and its link to the others.

Bandwidth and dense bf16/fp32 throughput come from the datasheet table in `platforms/device_specs.py`;
this table adds what a parallelism plan needs beyond a roofline: memory capacity, 8-bit matrix
throughput and the device-to-device interconnect. Figures are dense (no structured sparsity) for the
SXM/OAM boards. Capacity is what the driver reports (nvidia-smi / rocm-smi MiB / 1024), a little
under the marketing figure. Interconnect bandwidth is per device and per direction.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvforge.platforms.device_specs import DevicePeak, lookup_device_peak


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One device of a multi-device node, as far as memory, roofline and collectives go."""

    name: str
    memory_gib: float  # usable device memory
    peak: DevicePeak  # HBM GB/s, dense bf16 and fp32 TFLOP/s
    fp8_tflops: float | None  # dense fp8 matrix TFLOP/s; None: no fp8 units (fp8 weights run as bf16 math)
    int8_tops: float | None  # dense int8 matrix TOP/s; None: none
    interconnect: str  # e.g. "NVLink 4 (NVSwitch)"
    interconnect_gbs: float | None  # GB/s per device, one direction; None: a single device only
    collective_latency_us: float  # fixed cost of one small all-reduce or send over the interconnect
    host: bool = False  # the CPU: the engine runs float32 there

    def __post_init__(self) -> None:
        if self.memory_gib <= 0:
            raise ValueError(f"DeviceSpec.memory_gib must be > 0, got {self.memory_gib}")
        for name in ("fp8_tflops", "int8_tops", "interconnect_gbs"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"DeviceSpec.{name} must be > 0 or None, got {value}")
        if self.collective_latency_us < 0:
            raise ValueError(f"DeviceSpec.collective_latency_us must be >= 0, got {self.collective_latency_us}")

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)


def _known(marketing_name: str) -> DevicePeak:
    peak = lookup_device_peak(marketing_name)
    assert peak is not None, f"{marketing_name} is missing from platforms/device_specs.py"
    return peak


# NOTE: NVLink 4 is 900 GB/s both directions together (450 each way), NVLink 5 1.8 TB/s, NVLink 3
# 600 GB/s; MI300X/MI325X have 7 Infinity Fabric links of 64 GB/s each way to their 7 peers; L40S
# talks over PCIe 4.0 x16. The latencies are typical small-message all-reduce times of NCCL/RCCL.
_NVLINK4 = ("NVLink 4 (NVSwitch)", 450.0, 8.0)
_INFINITY_FABRIC = ("Infinity Fabric (xGMI mesh)", 448.0, 12.0)


def _table() -> dict[str, DeviceSpec]:
    return {
        "h100": DeviceSpec("H100 SXM 80GB", 79.2, _known("H100"), 1979.0, 1979.0, *_NVLINK4),
        "h200": DeviceSpec("H200 SXM 141GB", 139.8, _known("H200"), 1979.0, 1979.0, *_NVLINK4),
        "b200": DeviceSpec("B200 SXM 180GB", 179.1, _known("B200"), 4500.0, 4500.0,
                           "NVLink 5 (NVSwitch)", 900.0, 8.0),
        "a100-80gb": DeviceSpec("A100 SXM 80GB", 79.2, _known("A100"), None, 624.0,
                                "NVLink 3 (NVSwitch)", 300.0, 10.0),
        "a100-40gb": DeviceSpec("A100 SXM 40GB", 39.4, _known("A100-SXM4-40GB"), None, 624.0,
                                "NVLink 3 (NVSwitch)", 300.0, 10.0),
        "mi300x": DeviceSpec("MI300X OAM 192GB", 192.0, _known("MI300X"), 2614.9, 2614.9, *_INFINITY_FABRIC),
        "mi325x": DeviceSpec("MI325X OAM 256GB", 256.0, _known("MI325X"), 2614.9, 2614.9, *_INFINITY_FABRIC),
        "l40s": DeviceSpec("L40S 48GB", 44.4, _known("L40S"), 733.0, 733.0, "PCIe 4.0 x16", 32.0, 20.0),
        "cpu": DeviceSpec("CPU (host memory)", _host_memory_gib(), _CPU_PEAK, None, None, "none", None, 0.0,
                          host=True),
    }


# NOTE: CPUs differ by orders of magnitude; these are the 2-vCPU test VM of benchmarks/RESULTS.md
# (about 10 GB/s streaming weights during decode, about 0.12 TFLOP/s in fp32 matmuls).
_CPU_PEAK = DevicePeak(memory_bandwidth_gbs=10.0, bf16_tflops=0.12, fp32_tflops=0.12)


def _host_memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 16.0  # NOTE: a platform without sysconf: a nominal figure, override with --device-memory


DEVICE_TYPES: tuple[str, ...] = tuple(_table())


def get_device(device_type: str) -> DeviceSpec:
    """The spec of a device type name (h100, h200, b200, a100-80gb, a100-40gb, mi300x, mi325x, l40s, cpu)."""
    table = _table()
    spec = table.get(device_type.lower())
    if spec is None:
        raise ValueError(f"unknown device type {device_type!r}; known: {', '.join(table)}")
    return spec
