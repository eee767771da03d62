"""The other ranks of a tensor/pipeline-parallel engine record their own timelines.

While a profile runs, the distributed executor starts its ranks with `run_profiled_worker` instead of
`run_worker` (the same function, with a profiler around each rank's batches). Each rank writes its
steps (one batch each) and its Chrome trace into the folder named by KVFORGE_PROFILE_RANKS, when
the engine shuts down; the driver reads them back and merges them by batch.
"""

from __future__ import annotations

import gc
import json
import os
from dataclasses import asdict
from pathlib import Path

from torch.profiler import profile

from kvforge.profiler.ranges import Installed, install_collectives, install_runner
from kvforge.profiler.timeline import StepProfile, step_profiles
from kvforge.profiler.work import Work, build_inventory

RANKS_DIR_ENV = "KVFORGE_PROFILE_RANKS"


def run_profiled_worker(rank: int, config, init_method: str, local_rank: int, local_world: int) -> None:
    """multiproc.run_worker, with this rank's runner profiled from its first batch until it leaves the world."""
    from kvforge.executor import multiproc
    from kvforge.profiler.session import activities

    folder = Path(os.environ[RANKS_DIR_ENV])
    installed = Installed()
    state: dict = {}

    class ProfiledWorker(multiproc.Worker):
        def init_cache(self, size) -> None:
            super().init_cache(size)
            install_runner(installed, self.runner, batch_is_step=True)
            install_collectives(installed)
            state["runner"] = self.runner
            state["profiler"] = profile(activities=activities(self.device))
            state["profiler"].start()

    leave_world = multiproc.leave_world

    def write_then_leave() -> None:
        # NOTE: before the process group goes: a profiler that saw Gloo collectives crashes the exit after it
        if "profiler" in state:
            _write_rank(folder, rank, state.pop("profiler"), installed, state["runner"])
            gc.collect()
        leave_world()

    # NOTE: this process is a profiled rank and nothing else, so its executor module may be rewired
    multiproc.Worker = ProfiledWorker
    multiproc.leave_world = write_then_leave
    multiproc.run_worker(rank, config, init_method, local_rank, local_world)


def _write_rank(folder: Path, rank: int, prof: profile, installed: Installed, runner) -> None:
    prof.stop()
    inventory = build_inventory(runner.model, runner.kv_caches, runner.dtype)
    steps = step_profiles(prof.events(), installed.batches, inventory, rank=rank)
    prof.export_chrome_trace(str(folder / f"trace.rank{rank}.json.gz"))
    (folder / f"rank{rank}.json").write_text(json.dumps([asdict(s) for s in steps]))


def read_rank(folder: Path, rank: int, skip_batches: int) -> list[StepProfile]:
    """A rank's steps without the first skip_batches (the driver's warm-up), renumbered from 0."""
    path = folder / f"rank{rank}.json"
    if not path.is_file():
        raise RuntimeError(f"rank {rank} wrote no profile to {folder} (did it exit before the engine shut down?)")
    steps = []
    for item in json.loads(path.read_text()):
        if item["first_batch"] < skip_batches:
            continue
        item["work"] = {label: Work(**w) for label, w in item["work"].items()}
        item["first_batch"] -= skip_batches
        item["index"] = len(steps)
        steps.append(StepProfile(**item))
    return steps


def profiling_ranks(installed: Installed, folder: Path) -> None:
    """Make the engine about to be built start its other ranks profiled (undone by installed.remove())."""
    from kvforge.executor import multiproc

    folder.mkdir(parents=True, exist_ok=True)
    os.environ[RANKS_DIR_ENV] = str(folder)  # the ranks are spawned with this process's environment
    installed.patch(multiproc, "run_worker", run_profiled_worker)


def world_size(engine_kwargs: dict) -> int:
    return int(engine_kwargs.get("tensor_parallel_size") or 1) * int(engine_kwargs.get("pipeline_parallel_size") or 1)
