"""Roofline verdicts that match physics, on hand-built cases timed on this CPU against its measured peaks."""

from __future__ import annotations

import time

import pytest
import torch
from torch.profiler import profile

from kvforge.profiler.op_classes import MODEL, STEP
from kvforge.profiler.ranges import span
from kvforge.profiler.roofline import device_peaks, judge, summarize
from kvforge.profiler.timeline import step_profiles
from kvforge.profiler.work import Inventory, Work


@pytest.fixture(scope="module")
def peaks():
    return device_peaks(torch.device("cpu"), torch.float32)


def _best_seconds(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def test_a_large_square_matmul_is_compute_bound(peaks) -> None:
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    verdict = judge("gemm.mlp", _best_seconds(lambda: a @ b), Work(2 * n**3, 3 * n * n * 4), peaks)
    assert verdict.bound == "compute"
    assert verdict.compute_s > 10 * verdict.memory_s


def test_a_single_row_gemv_over_a_large_weight_is_memory_bound(peaks) -> None:
    n, k = 8192, 4096  # 128 MiB of fp32 weight, far beyond the caches
    weight, x = torch.randn(n, k), torch.randn(1, k)
    seconds = _best_seconds(lambda: torch.nn.functional.linear(x, weight))
    verdict = judge("gemm.mlp", seconds, Work(2 * n * k, (n * k + k + n) * 4), peaks)
    assert verdict.bound == "memory"
    assert verdict.memory_s > 4 * verdict.compute_s  # 0.5 FLOP per byte, far left of the ridge


def test_a_step_of_many_tiny_ops_is_overhead_bound(peaks) -> None:
    x = torch.ones(4)
    with profile() as prof:
        with span(STEP), span(MODEL), span("norm"):
            for _ in range(300):
                x = x * 1.0001 + 1e-6
    (step,) = step_profiles(prof.events(), [], Inventory(act_bytes=4, hidden=4))
    assert step.seconds["norm"] > 0.5 * step.wall_s  # the ops' own time counts for the range around them
    step.work = {"norm": Work(flops=300 * 2 * 4, bytes=300 * 2 * 2 * 4 * 4)}
    summary = summarize("decode", [step], peaks)
    (norm,) = [v for v in summary.verdicts if v.label == "norm"]
    assert norm.bound == "overhead" and norm.roof_fraction < 0.01
    assert summary.bound == "overhead"
    assert summary.ideal_s < 0.01 * summary.wall_s


def test_collectives_are_communication_bound_and_host_time_overhead(peaks) -> None:
    assert judge("communication", 1e-3, Work(), peaks).bound == "communication"
    assert judge("pipeline_wait", 1e-3, Work(), peaks).ideal_s == 1e-3
    assert judge("host.schedule", 1e-3, Work(), peaks).bound == "overhead"
