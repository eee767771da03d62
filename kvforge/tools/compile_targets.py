"""The GPUs `kvforge compile-kernels` compiles for: what Triton and the engine's launchers need of each."""

from __future__ import annotations

from dataclasses import dataclass

from kvforge.platforms import Platform, lookup_device_peak


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
