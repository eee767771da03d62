"""The other ranks of a tensor/pipeline-parallel engine record their own timelines.

While a profile runs, the driver hands the engine's executor a `RankProfile` (executor.start_profile), and the
executor passes it to every other rank's worker (Worker.start_profile), which records its batches (one step each)
until executor.stop_profile; it then writes its steps and its Chrome trace into the profile's folder, before the
engine shuts down. The driver reads them back and merges them by batch.
"""

from __future__ import annotations

import gc
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from torch.profiler import profile

from kvforge.profiler.ranges import Installed, install_collectives, install_runner
from kvforge.profiler.timeline import StepProfile, step_profiles
from kvforge.profiler.work import Work, build_inventory


@dataclass(slots=True)
class RankProfile:
    """A rank's profiler (a RankProfiler of the executor): its runner's batches ranged, torch.profiler on, from
    start to stop, then rank<r>.json (its steps) and trace.rank<r>.json.gz written into folder. Made by the driver
    with only the folder; each rank starts its own copy."""

    folder: Path
    installed: Installed = field(default_factory=Installed)
    profiler: profile | None = None

    def start(self, worker) -> None:
        from kvforge.profiler.session import activities

        install_runner(self.installed, worker.runner, batch_is_step=True)
        install_collectives(self.installed)
        self.profiler = profile(activities=activities(worker.device))
        self.profiler.start()

    def stop(self, worker) -> None:
        prof, self.profiler = self.profiler, None
        prof.stop()
        runner = worker.runner
        rank = runner.parallel.rank
        inventory = build_inventory(runner.model, runner.kv_caches, runner.dtype)
        steps = step_profiles(prof.events(), self.installed.batches, inventory, rank=rank)
        prof.export_chrome_trace(str(self.folder / f"trace.rank{rank}.json.gz"))
        (self.folder / f"rank{rank}.json").write_text(json.dumps([asdict(s) for s in steps]))
        self.installed.remove()
        # NOTE: a profiler that saw Gloo collectives must be gone before the process group is destroyed
        del prof
        gc.collect()

    def __getstate__(self) -> dict:
        return {"folder": self.folder}  # what a rank's copy starts from

    def __setstate__(self, state: dict) -> None:
        self.folder, self.installed, self.profiler = state["folder"], Installed(), None


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


def world_size(engine_kwargs: dict) -> int:
    return int(engine_kwargs.get("tensor_parallel_size") or 1) * int(engine_kwargs.get("pipeline_parallel_size") or 1)
