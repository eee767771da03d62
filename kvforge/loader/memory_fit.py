"""Refuse a CPU model that cannot fit, before loading it: the weights in the form they are kept, the KV cache
budget and a working set, against the memory this process may still take.

    needed     = weights (kept GGUF blocks at their kernel's bytes, everything else in the run dtype)
                 + KV cache budget + WORKING_SET
    available  = min(MemAvailable, the cgroup's limit - its usage)        (cgroup v2 or v1, where one is set)

Without the check, a model past the memory left is killed by the kernel's OOM killer partway through its load, with
no message of its own.
"""

from __future__ import annotations

from pathlib import Path

WORKING_SET = 512 * 2**20  # activations, the step's buffers, one layer's checkpoint tensors while it converts
_CGROUP_V2 = ("memory.max", "memory.current")
_CGROUP_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes")


def available_memory() -> int:
    """Bytes this process may still allocate: the system's MemAvailable, or less where its cgroup sets a limit."""
    available = _meminfo_available()
    for limit, usage in _cgroup_limits():
        available = min(available, max(limit - usage, 0))
    return available


def _meminfo_available() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemAvailable in /proc/meminfo")


def _cgroup_limits() -> list[tuple[int, int]]:
    """(limit, usage) of this process's memory cgroup, where it has a numeric limit."""
    found = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            folder, names = Path("/sys/fs/cgroup") / path.lstrip("/"), _CGROUP_V2
        elif "memory" in controllers.split(","):
            folder, names = Path("/sys/fs/cgroup/memory") / path.lstrip("/"), _CGROUP_V1
        else:
            continue
        try:
            limit, usage = ((folder / name).read_text().strip() for name in names)
        except OSError:
            continue
        if limit.isdigit() and int(limit) < 2**60:
            found.append((int(limit), int(usage)))
    return found


def check_fits(what: str, weight_bytes: int, kv_cache_bytes: int, available: int | None = None) -> None:
    """ValueError naming both figures and what to change, where the model will not fit in the memory left."""
    needed = weight_bytes + kv_cache_bytes + WORKING_SET
    available = available_memory() if available is None else available
    if needed > available:
        raise ValueError(
            f"{what} needs ~{needed / 2**30:.1f} GiB (weights {weight_bytes / 2**30:.1f} GiB as kept, KV cache "
            f"{kv_cache_bytes / 2**30:.1f} GiB, working set {WORKING_SET / 2**30:.1f} GiB) but only "
            f"{available / 2**30:.1f} GiB of memory is available: lower --kv-cache-memory, load a smaller "
            f"quantization type (e.g. Q4_K_M) or model, or split it with --tensor-parallel-size")
