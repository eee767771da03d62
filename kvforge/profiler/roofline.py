"""Roofline verdicts: what bounds each op class, how far it is from its roof, and the ideal step.

    compute_s = FLOPs / peak FLOP/s        memory_s = bytes / peak bandwidth
    ideal_s = max(compute_s, memory_s)     roof fraction = ideal_s / measured seconds

    communication   collectives and pipeline waits (no roof here: they take what they measured)
    overhead        host time, or an op at under OVERHEAD_FRACTION of its roof (launches, Python, tiny
                    tensors: the time goes to neither the math nor the memory)
    compute/memory  whichever roof is the higher (the op is within reach of it)

Peaks: measured here on the CPU (a short square matmul and a copy), the datasheet of the platform's
table (platforms/device_specs.py) on a known GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.benchmarks.kernels import Peaks, datasheet_peaks, measure_peaks
from kvforge.profiler.op_classes import HOST_CLASSES, MODEL_CLASSES, PARALLEL_CLASSES
from kvforge.profiler.work import Work

OVERHEAD_FRACTION = 0.1
# NOTE: 1024^3 matmul (2 GFLOP) and a 256 MiB copy: long enough to leave the caches, short enough (about
# a second in all on a 2-core CPU) to run before every profile.
PROBE_MATMUL_N = 1024
PROBE_COPY_MIB = 256


def device_peaks(device: torch.device, dtype: torch.dtype) -> Peaks:
    """Datasheet peaks of a known GPU, else peaks measured on this device."""
    if device.type != "cpu":
        from kvforge.platforms import current_platform

        known = datasheet_peaks(current_platform(), dtype)
        if known is not None:
            return known
    # NOTE: the better of two probes: a probe that another process slowed down would flatter every op
    probes = [measure_peaks(device, dtype, quick=False, matmul_n=PROBE_MATMUL_N, copy_mib=PROBE_COPY_MIB)
              for _ in range(2)]
    return Peaks(max(p.bandwidth_gbs for p in probes), max(p.tflops for p in probes), "measured")


@dataclass(frozen=True, slots=True)
class Verdict:
    """One op class over a set of steps, on the roofline."""

    label: str
    seconds: float
    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    bound: str  # compute, memory, overhead or communication

    @property
    def ideal_s(self) -> float:
        return self.seconds if self.bound == "communication" else max(self.compute_s, self.memory_s)

    @property
    def roof_fraction(self) -> float:
        return self.ideal_s / self.seconds if self.seconds > 0 else 0.0

    @property
    def gflops_per_s(self) -> float:
        return self.flops / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def gbytes_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def intensity(self) -> float:
        """FLOPs per byte."""
        return self.flops / self.bytes if self.bytes > 0 else 0.0


def judge(label: str, seconds: float, work: Work, peaks: Peaks) -> Verdict:
    """The verdict of an op class that took `seconds` for `work` on a device of these peaks."""
    compute_s = work.flops / (peaks.tflops * 1e12)
    memory_s = work.bytes / (peaks.bandwidth_gbs * 1e9)
    if label in PARALLEL_CLASSES:
        bound = "communication"
    elif label in HOST_CLASSES or seconds <= 0 or max(compute_s, memory_s) < OVERHEAD_FRACTION * seconds:
        bound = "overhead"
    else:
        bound = "compute" if compute_s >= memory_s else "memory"
    return Verdict(label, seconds, work.flops, work.bytes, compute_s, memory_s, bound)


@dataclass(frozen=True, slots=True)
class StepSummary:
    """Steps of one kind (prefill or decode) on one rank: mean times, what bounds them, the ideal step."""

    kind: str
    num_steps: int
    mean_seqs: float
    wall_s: float  # mean per step
    model_s: float
    host_s: float
    ideal_s: float  # every model op class at its roof, communication as measured, no host time
    bound: str  # the verdict that holds the most of the step's time (host time counts as overhead)
    verdicts: tuple[Verdict, ...]  # per class, mean per step


def summarize(kind: str, steps: list, peaks: Peaks) -> StepSummary:
    """The summary of steps (timeline.StepProfile) of one kind."""
    count = len(steps)
    labels = [c for c in (*MODEL_CLASSES, *PARALLEL_CLASSES, *HOST_CLASSES)
              if any(c in s.seconds or c in s.work for s in steps)]
    verdicts = []
    for label in labels:
        seconds = sum(_seconds(s, label) for s in steps) / count
        work = Work(sum(s.work[label].flops for s in steps if label in s.work) / count,
                    sum(s.work[label].bytes for s in steps if label in s.work) / count)
        verdicts.append(judge(label, seconds, work, peaks))
    by_bound: dict[str, float] = {}
    for v in verdicts:
        by_bound[v.bound] = by_bound.get(v.bound, 0.0) + v.seconds
    bound = max(by_bound, key=by_bound.get) if by_bound else "overhead"
    ideal = sum(v.ideal_s for v in verdicts if v.label not in HOST_CLASSES)
    return StepSummary(kind, count, sum(s.num_seqs for s in steps) / count, sum(s.wall_s for s in steps) / count,
                       sum(s.model_s for s in steps) / count, sum(s.host_s for s in steps) / count, ideal, bound,
                       tuple(verdicts))


def _seconds(step, label: str) -> float:
    """Kernel time on a GPU (what the roofline is about), the CPU time on the CPU."""
    if step.device_seconds and label in MODEL_CLASSES:
        return step.device_seconds.get(label, 0.0)
    return step.seconds.get(label, 0.0)
