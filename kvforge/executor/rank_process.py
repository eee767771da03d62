"""The process of one local rank: a fresh interpreter running kvforge's own entry point.

    python -m kvforge.executor.rank_process   < pickled (config, rank, init_method, local_rank, local_world)

The engine's process starts ranks 1.. this way instead of with multiprocessing, whose `spawn`
re-imports the user's `__main__` in every child: a script without an `if __name__ == "__main__":`
guard would build its engine again in each rank, and die in Python's bootstrapping check. Here the
child imports only kvforge; the ranks meet over TCP (torch.distributed's `tcp://` rendezvous).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kvforge.config import EngineConfig

# The folder that holds the kvforge package, so the child imports this same copy of it.
_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])


@dataclass(frozen=True, slots=True)
class RankArgs:
    """What a rank needs to join the world (picklable: it travels on the child's stdin)."""

    config: EngineConfig
    rank: int
    init_method: str
    local_rank: int
    local_world: int


def start_rank(args: RankArgs) -> subprocess.Popen:
    """Start the rank's process; it runs until the engine sends it the shutdown command."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
    process = subprocess.Popen([sys.executable, "-m", "kvforge.executor.rank_process"], stdin=subprocess.PIPE,
                               env=env)
    assert process.stdin is not None
    try:
        process.stdin.write(pickle.dumps(args))
        process.stdin.close()
    except BrokenPipeError:  # it died at once; the caller sees its exit code
        pass
    return process


def main() -> None:
    from kvforge.executor.multiproc import run_worker

    args: RankArgs = pickle.load(sys.stdin.buffer)
    run_worker(args.rank, args.config, args.init_method, args.local_rank, args.local_world)


if __name__ == "__main__":
    main()
