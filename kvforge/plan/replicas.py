"""Data-parallel replicas: how many replicas of which TP x PP split serve a request rate within a TTFT bound.

A replica serves requests of P prompt tokens (a share `prefix_hit_rate` of them found in its prefix cache, as
the cache-aware router keeps them) and O output tokens. Its bounds from the roofline (throughput.py), at the
largest batch that fits, give the device time one request takes:

    s = P (1 - hit) / prefill tokens/s  +  O / decode tokens/s        capacity = 1 / s requests/s

With Poisson arrivals spread evenly over r replicas (rate lambda / r each, utilisation rho = lambda s / r), a
request waits on average as in an M/D/1 queue before its prompt runs, and then takes its own prefill:

    TTFT = W + TTFT alone,   W = rho s / (2 (1 - rho))

The plan takes, for each split, the fewest replicas whose TTFT is within the bound (rho < 1), and recommends the
split that needs the fewest devices in all (then the lower TTFT). These are bounds from the roofline: measured
speeds are lower, so measure one replica (`kvforge bench serve`) before buying devices.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvforge.plan.devices import DeviceSpec
from kvforge.plan.estimate import PlanOptions, estimate_split
from kvforge.plan.model_shape import ModelShape
from kvforge.plan.precision import Precision


@dataclass(frozen=True, slots=True)
class Traffic:
    """The load to serve: requests/s, tokens per request, the TTFT bound and the prefix-cache hit rate."""

    request_rate: float
    prompt_tokens: int = 1024
    output_tokens: int = 256
    ttft_ms: float = 1000.0
    prefix_hit_rate: float = 0.0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 requests/s, got {self.request_rate}")
        for name in ("prompt_tokens", "output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.ttft_ms > 0:
            raise ValueError(f"ttft_ms must be > 0, got {self.ttft_ms}")
        if not 0 <= self.prefix_hit_rate < 1:
            raise ValueError(f"prefix_hit_rate must be in [0, 1), got {self.prefix_hit_rate}")


@dataclass(frozen=True, slots=True)
class ReplicaEstimate:
    """One TP x PP split as a replica: its capacity, and the replicas the traffic needs (0 when none suffice)."""

    tp: int
    pp: int
    problem: str | None
    capacity_rps: float = 0.0  # requests/s one replica sustains
    ttft_alone_ms: float = 0.0  # one prompt on an idle replica
    num_replicas: int = 0
    utilisation: float = 0.0
    ttft_ms: float = 0.0  # mean, with queueing, at num_replicas

    @property
    def num_devices(self) -> int:
        return self.tp * self.pp * self.num_replicas


def queued_ttft_ms(service_s: float, ttft_alone_ms: float, rate_per_replica: float) -> float | None:
    """Mean TTFT of an M/D/1 replica (service time service_s) at this arrival rate; None when it cannot keep up."""
    rho = rate_per_replica * service_s
    if rho >= 1:
        return None
    return ttft_alone_ms + 1e3 * rho * service_s / (2 * (1 - rho))


def estimate_replicas(shape: ModelShape, device: DeviceSpec, precision: Precision, options: PlanOptions,
                      traffic: Traffic, tp: int, pp: int, max_replicas: int) -> ReplicaEstimate:
    """The fewest replicas of TP x PP (at most max_replicas) that serve the traffic within its TTFT bound."""
    if tp * pp > 1 and device.interconnect_gbs is None:
        return ReplicaEstimate(tp, pp, f"{device.name} has no device-to-device interconnect")
    options = replace(options, context_len=traffic.prompt_tokens + traffic.output_tokens, num_devices=tp * pp)
    split = estimate_split(shape, device, precision, options, tp, pp)
    if split.problem is not None or split.decode is None or split.prefill is None:
        return ReplicaEstimate(tp, pp, split.problem or "does not fit")
    new_prompt_tokens = traffic.prompt_tokens * (1 - traffic.prefix_hit_rate)
    service_s = new_prompt_tokens / split.prefill.tokens_per_s + traffic.output_tokens / split.decode.tokens_per_s
    ttft_alone_ms = split.prefill.latency_ms * (1 - traffic.prefix_hit_rate)
    estimate = ReplicaEstimate(tp, pp, None, 1 / service_s, ttft_alone_ms)
    if ttft_alone_ms > traffic.ttft_ms:
        return replace(estimate, problem=f"one prompt alone takes {ttft_alone_ms:,.0f} ms to its first token")
    for num_replicas in range(1, max_replicas + 1):
        ttft = queued_ttft_ms(service_s, ttft_alone_ms, traffic.request_rate / num_replicas)
        if ttft is not None and ttft <= traffic.ttft_ms:
            return replace(estimate, num_replicas=num_replicas, ttft_ms=ttft,
                           utilisation=traffic.request_rate / num_replicas * service_s)
    return replace(estimate, problem=f"{max_replicas} replicas ({max_replicas * tp * pp} devices) are not enough")


def plan_replicas(shape: ModelShape, device: DeviceSpec, precision: Precision, options: PlanOptions,
                  traffic: Traffic) -> tuple[list[ReplicaEstimate], ReplicaEstimate | None]:
    """Every split of up to options.num_devices devices as replicas, and the one needing the fewest devices."""
    num_devices = options.num_devices
    estimates = [estimate_replicas(shape, device, precision, options, traffic, tp, group // tp, num_devices // group)
                 for group in range(1, num_devices + 1) for tp in range(1, group + 1) if group % tp == 0]
    usable = [e for e in estimates if e.problem is None]
    best = min(usable, key=lambda e: (e.num_devices, e.ttft_ms), default=None)
    return estimates, best


def format_replicas(estimates: list[ReplicaEstimate], best: ReplicaEstimate | None, traffic: Traffic,
                    num_devices: int) -> str:
    lines = [f"traffic  {traffic.request_rate:g} requests/s of {traffic.prompt_tokens} prompt + "
             f"{traffic.output_tokens} output tokens ({traffic.prefix_hit_rate:.0%} of prompt tokens cached), "
             f"TTFT <= {traffic.ttft_ms:g} ms, up to {num_devices} devices", "",
             "per replica: capacity (requests/s) and TTFT alone are roofline bounds; TTFT with queueing is M/D/1"]
    header = ("TP", "PP", "capacity req/s", "TTFT alone ms", "replicas", "devices", "utilisation", "TTFT ms")
    rows = [(str(e.tp), str(e.pp),
             *((f"{e.capacity_rps:,.2f}", f"{e.ttft_alone_ms:,.0f}") if e.capacity_rps else ("-",) * 2),
             *((str(e.num_replicas), str(e.num_devices), f"{e.utilisation:.0%}", f"{e.ttft_ms:,.0f}")
               if e.problem is None else ("-",) * 4)) for e in estimates]
    widths = [max(len(header[i]), *(len(row[i]) for row in rows)) for i in range(len(header))]
    lines.append("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for estimate, row in zip(estimates, rows):
        note = "" if estimate.problem is None else f"  ({estimate.problem})"
        lines.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) + note)
    if best is None:
        lines += ["", "no split serves this traffic within the bound on these devices"]
    else:
        command = (f"kvforge serve --data-parallel-size {best.num_replicas} --tensor-parallel-size {best.tp} "
                   f"--pipeline-parallel-size {best.pp}")
        lines += ["", f"recommended: {best.num_replicas} replicas of TP={best.tp} x PP={best.pp} "
                      f"({best.num_devices} devices; {command}): mean TTFT {best.ttft_ms:,.0f} ms at "
                      f"{best.utilisation:.0%} utilisation"]
    return "\n".join(lines)
