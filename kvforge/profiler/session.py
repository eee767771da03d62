"""Profile one engine on a workload: ranges installed, torch.profiler on, per-step profiles out.

The engine is stepped here (as `bench latency` does), each step inside a kvforge:step range; new
requests join as others finish, so at most `concurrency` run at once. As many short requests as will run at once
warm the engine up (and compile its decode bucket) before the profiler starts.
"""

from __future__ import annotations

import gc
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kvforge.benchmarks.workload import Workload
from kvforge.profiler.op_classes import STEP
from kvforge.profiler.ranges import Installed, install, span
from kvforge.profiler.timeline import StepProfile, step_profiles
from kvforge.profiler.work import build_inventory
from kvforge.sampling_params import SamplingParams


@dataclass(slots=True)
class RankTimeline:
    """What the driver's rank recorded: its steps, and how many batches ran before the profiler started."""

    steps: list[StepProfile]
    warmup_batches: int


def activities(device: torch.device) -> list[ProfilerActivity]:
    """The CPU, plus the GPU's kernels (CUDA and ROCm alike) when the engine runs on one."""
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def drive(engine, workload: Workload, concurrency: int) -> int:
    """Run every request of workload, at most `concurrency` at once (0: all); returns the steps taken."""
    pending = deque(enumerate(zip(workload.prompts, workload.output_lens)))
    limit = concurrency or len(pending)
    running, num_steps = 0, 0
    while pending or engine.has_unfinished_requests():
        while pending and running < limit:
            index, (prompt, output_len) = pending.popleft()
            params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
            engine.add_request(f"profile-{index}", {"prompt_token_ids": prompt}, params)
            running += 1
        with span(STEP):
            outputs = engine.step()
        num_steps += 1
        running -= sum(1 for o in outputs if o.finished)
    return num_steps


def warm_up(engine, num_requests: int) -> None:
    """Compile the decode bucket that num_requests fill, then run that many short requests at once, so that no
    compile runs beside the profile."""
    graphs = engine.runner.decode_graphs
    if graphs is not None:
        graphs.compile_ahead(num_requests)
    for index in range(num_requests):
        engine.add_request(f"profile-warmup-{index}", {"prompt_token_ids": list(range(1, 9))},
                           SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def profile_engine(engine, workload: Workload, concurrency: int, trace_path: Path | None) -> RankTimeline:
    """Profile the workload on engine (this process's rank); the ranges are off again afterwards."""
    installed: Installed = install(engine)
    try:
        warm_up(engine, min(concurrency or len(workload.prompts), len(workload.prompts)))
        warmup_batches = len(installed.batches)
        with profile(activities=activities(engine.device)) as prof:
            drive(engine, workload, concurrency)
        events = prof.events()
        if trace_path is not None:
            prof.export_chrome_trace(str(trace_path))
        runner = engine.runner
        inventory = build_inventory(runner.model, runner.kv_caches, runner.dtype)
        steps = step_profiles(events, installed.batches[warmup_batches:], inventory, rank=0)
        # NOTE: a profiler that saw Gloo collectives must be gone before the process group is destroyed
        # (engine.shutdown()), or the process crashes on exit (torch 2.13)
        del prof, events
        gc.collect()
        return RankTimeline(steps, warmup_batches)
    finally:
        installed.remove()
