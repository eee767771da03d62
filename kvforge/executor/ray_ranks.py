"""The ranks beyond the engine's own as Ray actors (`--distributed-executor-backend ray`), placed with a placement
group: one bundle per pipeline stage, holding that stage's tensor-parallel ranks on one node (they talk every
layer), the stages spread over the nodes (they talk once per step).

```
 engine process (rank 0, the driver's node)       Ray node B
  stage 0 bundle {CPU: tp-1, node:<driver ip>}    stage 1 bundle {CPU: tp}
   rank 1 actor                                    rank 2 actor, rank 3 actor        (tp=2, pp=2)
```

Each actor runs the same `run_worker` as a rank process of the multiprocessing backend; the ranks meet over
torch.distributed at the engine's address as Ray reports it (Gloo on CPUs, NCCL/RCCL on GPUs). To the executor
an actor looks like a rank process: `poll`, `wait`, `kill`, `returncode`, `pid`.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
from pathlib import Path

from kvforge.config import EngineConfig

logger = logging.getLogger(__name__)

# The folder that holds the kvforge package: the actors import this same copy of it (on a shared file system, or
# where it is installed at the same path).
_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])


class RankActor:
    """One rank in a Ray worker process (made a Ray actor class by `_actor_class`)."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, rank: int, config: EngineConfig, init_method: str, local_rank: int, local_world: int) -> None:
        from kvforge.executor.multiproc import run_worker

        run_worker(rank, config, init_method, local_rank, local_world)


class RayRank:
    """A rank's actor and its running `run` call, with the part of subprocess.Popen's interface the executor uses."""

    def __init__(self, actor, rank: int, config: EngineConfig, init_method: str, local_world: int) -> None:
        import ray

        self.actor = actor
        self.pid = ray.get(actor.pid.remote())
        # NOTE: Ray gives each GPU actor its own CUDA_VISIBLE_DEVICES, so its device is cuda:0 (local rank 0)
        self.done = actor.run.remote(rank, config, init_method, 0, local_world)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        import ray

        if self.returncode is None and ray.wait([self.done], timeout=0)[0]:
            try:
                ray.get(self.done)
                self.returncode = 0
            except ray.exceptions.RayError as error:
                logger.error("a Ray rank failed: %s", error)
                self.returncode = 1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import ray

        ready, _ = ray.wait([self.done], timeout=timeout)
        if not ready:
            raise subprocess.TimeoutExpired("ray actor", timeout)
        return self.poll()

    def kill(self) -> None:
        import ray

        ray.kill(self.actor)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _actor_class():
    import ray

    return ray.remote(RankActor)


def connect(address: str | None, needed_by: str = "--distributed-executor-backend ray") -> bool:
    """Join the Ray cluster at `address` (None: $RAY_ADDRESS, else a new local one) unless this process has;
    True when this call connected (the caller disconnects at shutdown, see `release`). `needed_by` names the
    flag that asked for Ray, for the error where it is not installed."""
    try:
        import ray
    except ImportError as error:
        raise ValueError(f"{needed_by} needs Ray: pip install 'kvforge[ray]'") from error
    if ray.is_initialized():
        return False
    # NOTE: "local", not None: ray.init(None) joins whatever cluster `ray start` last left on this machine
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    ray.init(address=address, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"PYTHONPATH": _PACKAGE_PARENT}})
    return True


def reserve(bundles: list[dict[str, float]], strategy: str, what: str) -> object:
    """A placement group of `bundles` placed with `strategy` (ready to use); ValueError naming `what` and the
    cluster's resources where it finds no room within 5 minutes."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group(bundles, strategy=strategy)
    try:
        ray.get(group.ready(), timeout=300)
    except ray.exceptions.GetTimeoutError as error:
        remove_placement_group(group)
        raise ValueError(f"the Ray cluster has no room for {what} ({bundles}, {strategy}): "
                         f"{ray.cluster_resources()}") from error
    return group


def start_ray_ranks(config: EngineConfig, on_gpu: bool) -> tuple[str, list[RayRank], object]:
    """Place and start ranks 1..world-1: the init method of the world (rank 0 is this process), the ranks, and
    the placement group (for `release`)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    tp, pp = config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size
    driver_ip = ray.util.get_node_ip_address()
    unit = "GPU" if on_gpu else "CPU"
    bundles = [{unit: tp - 1, f"node:{driver_ip}": 0.001} if stage == 0 else {unit: tp} for stage in range(pp)]
    first = 0 if tp > 1 else 1  # a stage-0 bundle only where stage 0 has ranks beyond this process's
    group = reserve(bundles[first:], "SPREAD" if pp > 1 else "PACK", f"{tp} x {pp} ranks")
    init_method = f"tcp://{driver_ip}:{_free_port()}"
    actor_class = _actor_class()
    ranks = []
    for rank in range(1, tp * pp):
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank // tp - first)
        actor = actor_class.options(num_cpus=0 if on_gpu else 1, num_gpus=1 if on_gpu else 0,
                                    scheduling_strategy=strategy).remote()
        ranks.append(RayRank(actor, rank, config, init_method, local_world=tp))
    logger.info("%d Ray actors placed (%s); the world meets at %s", len(ranks), bundles[first:], init_method)
    return init_method, ranks, group


def release(group: object | None, connected: bool) -> None:
    """Free the placement group's resources (if one was made); leave the cluster if `connect` joined it (a local
    one ends)."""
    import ray
    from ray.util.placement_group import remove_placement_group

    if ray.is_initialized():
        if group is not None:
            remove_placement_group(group)
        if connected:
            ray.shutdown()
