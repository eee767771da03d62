"""`kvforge profile`: run a workload on the engine under torch.profiler and say where each step's time
goes, against the device's roofline.

    kvforge profile --num-prompts 1 --output-len 64                 # single stream, the default model
    kvforge profile --workload w64.json --concurrency 64 --out prof # 64 streams

Writes into --out: profile.json (every step of every rank, the summaries), trace.json.gz (Chrome/Perfetto
open it as is; ranks/trace.rank<r>.json.gz for the other ranks) and profile.png (the roofline and the per-step bars).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from kvforge.benchmarks.workload import add_workload_arguments, workload_from_args
from kvforge.engine_args import add_engine_arguments, engine_kwargs_from_args
from kvforge.profiler.ranks import RankProfile, read_rank
from kvforge.profiler.report import Profile, format_table, write_json
from kvforge.profiler.roofline import device_peaks
from kvforge.profiler.session import profile_engine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser, num_prompts=8, output_len=32)
    parser.add_argument("--concurrency", type=int, default=0, help="most requests in flight (0: all at once)")
    parser.add_argument("--out", type=Path, default=Path("profile"), help="folder for the JSON, trace and PNG")
    parser.add_argument("--no-trace", dest="trace", action="store_false", help="skip the Chrome trace files")
    add_engine_arguments(parser)


def attribution(steps: list) -> str:
    """How the op times of these steps were attributed, in words for the report."""
    text = "record_function ranges (eager)"
    num_compiled = sum(1 for s in steps if s.compiled)
    if num_compiled:
        text += (f"; {num_compiled} steps ran compiled (torch.compile drops the ranges inside its graph): "
                 "there the custom ops keep their names, the matmuls count together as gemm.compiled and "
                 "Inductor's fused code as fused; --enforce-eager gives every step per-layer ranges")
    num_compiling = sum(1 for s in steps if s.compiling)
    if num_compiling:
        text += f"; {num_compiling} steps compiled a graph and are left out of the summaries"
    return text


def profile_workload(engine_kwargs: dict, workload, concurrency: int, out: Path, trace: bool = True) -> Profile:
    """Build an engine, profile the workload on it (and on its other ranks), shut it down; the Profile."""
    from kvforge import LLM

    if concurrency < 0:
        raise ValueError(f"--concurrency must be >= 0, got {concurrency}")
    ranks_dir = out / "ranks"
    ranks_dir.mkdir(parents=True, exist_ok=True)
    llm = LLM(**engine_kwargs)
    engine = llm.engine
    try:
        # the other ranks (if any) record from here, as this one does from profile_engine's start: the same batches
        engine.executor.start_profile(RankProfile(ranks_dir))
        timeline = profile_engine(engine, workload, concurrency, out / "trace.json.gz" if trace else None)
        engine.executor.stop_profile()  # each rank writes its steps and trace
        dtype = engine.runner.dtype
        peaks = device_peaks(engine.device, dtype)
        world = getattr(engine.executor, "world_size", 1)
    finally:
        llm.shutdown()
    ranks = {0: timeline.steps}
    for rank in range(1, world):
        ranks[rank] = read_rank(ranks_dir, rank, timeline.warmup_batches)
    device = str(engine.device) if engine.device.type == "cpu" else torch.cuda.get_device_name(engine.device)
    return Profile(Path(engine.model_name).name, device, str(dtype).removeprefix("torch."), peaks,
                   attribution(timeline.steps), ranks)


def run(args: argparse.Namespace) -> int:
    from kvforge.profiler.plot import write_png

    profile = profile_workload(engine_kwargs_from_args(args), workload_from_args(args), args.concurrency,
                               args.out, args.trace)
    print(format_table(profile))
    write_json(profile, args.out / "profile.json")
    wrote = ["profile.json"] + (["trace.json.gz"] if args.trace else [])
    if write_png(profile, args.out / "profile.png"):
        wrote.append("profile.png")
    print(f"\nwrote {', '.join(str(args.out / name) for name in wrote)}")
    sys.stdout.flush()
    return 0
