"""The distributed executor: the engine's process is rank 0; the other ranks run `run_worker`.

On one machine the executor starts the other ranks itself: one fresh interpreter each, running
`kvforge.executor.rank_process` (the user's script is never re-imported). Across machines,
torchrun starts the same command on every node; rank 0 runs the engine and every other rank turns
into a worker inside `LLM(...)` and exits when the engine shuts down:

    # on each of 2 nodes (node-rank 0 and 1), 2 ranks per node: TP=2 within a node, PP=2 across
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr HOST0 --master-port 29500 \\
        -m kvforge.cli generate "Hello" --tensor-parallel-size 2 --pipeline-parallel-size 2

Each step rank 0 sends the SchedulerOutput to every rank (point-to-point, asynchronous), runs its
own share, and receives the sampled tokens from the last stage's first rank. A rank that dies
breaks its connections; the engine then fails with an error naming it instead of hanging.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque

import torch
import torch.distributed as dist

from kvforge.config import DeviceConfig, EngineConfig
from kvforge.distributed.communicator import (
    TAG_COMMAND,
    TAG_RESULT,
    forget_sends,
    recv_object,
    send_object,
    wait_for_sends,
)
from kvforge.distributed.parallel_state import building_with, init_parallel_state, leave_world
from kvforge.executor.device import resolve_device
from kvforge.executor.executor import Executor
from kvforge.executor.rank_process import RankArgs, start_rank
from kvforge.executor.worker import RankProfiler, Worker, agree_kv_cache_size
from kvforge.step_data import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

_EXECUTE, _SCORE, _SHUTDOWN = "execute", "score", "shutdown"
_START_PROFILE, _STOP_PROFILE = "start_profile", "stop_profile"  # the payload of a start: the RankProfiler


def rank_device(config: DeviceConfig, local_rank: int) -> torch.device:
    """Rank r on a machine uses GPU r (CUDA or ROCm) when the device resolves to a GPU, else the CPU."""
    if config.device.startswith("cuda:"):
        raise ValueError(f"with several ranks give --device cuda (rank r uses cuda:<local rank>), not {config.device}")
    device = resolve_device(config)
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def _share_cpu_threads(device: torch.device, ranks_on_this_machine: int) -> None:
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_on_this_machine))


def run_worker(rank: int, config: EngineConfig, init_method: str, local_rank: int, local_world: int) -> None:
    """A rank other than 0: join the world, load the shard, then run commands until told to stop."""
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s rank{rank} %(name)s: %(message)s")
    device = rank_device(config.device, local_rank)
    _share_cpu_threads(device, local_world)
    state = init_parallel_state(rank, config.parallel.tensor_parallel_size,
                                config.parallel.pipeline_parallel_size, init_method, device)
    with building_with(state):
        worker = Worker(config, device)
        worker.init_cache(agree_kv_cache_size(worker, state))
    while True:
        kind, payload = recv_object(state, 0, TAG_COMMAND)
        if kind == _SHUTDOWN:
            break
        if kind == _START_PROFILE:
            worker.start_profile(payload)
        elif kind == _STOP_PROFILE:
            worker.stop_profile()
        else:
            result = worker.execute(payload) if kind == _EXECUTE else worker.score(payload)
            if rank == state.sampler_rank:
                send_object(state, result, 0, TAG_RESULT)
    wait_for_sends()
    # NOTE: before the process group goes: a profiler that saw Gloo collectives crashes the exit after it
    worker.stop_profile()
    leave_world()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class DistributedExecutor(Executor):
    """Rank 0 of tp x pp ranks: starts the local ranks (unless torchrun did), holds rank 0's worker."""

    def __init__(self, config: EngineConfig) -> None:
        parallel = config.parallel
        self.world_size = parallel.world_size
        self.max_in_flight = parallel.pipeline_parallel_size
        self.processes: list[subprocess.Popen] = []  # or RayRank actors, which look the same to the executor
        self._ray_group: tuple[object, bool] | None = None  # a Ray placement group, and whether we joined Ray
        self._results: deque[ModelRunnerOutput | None] = deque()
        self._closed = False
        self._num_threads = torch.get_num_threads()  # this process's, restored at shutdown
        if dist.is_initialized():
            self._closed = True
            raise ValueError("this process already runs a distributed engine; shut it down first (LLM.shutdown())")
        init_method, local_world = self._launch(config)
        try:
            device = rank_device(config.device, 0)
            _share_cpu_threads(device, local_world)
            self.state = self._while_ranks_alive(lambda: init_parallel_state(
                0, parallel.tensor_parallel_size, parallel.pipeline_parallel_size, init_method, device))
            with building_with(self.state):
                self.worker = Worker(config, device)
                self.kv_cache_size = self._guarded(agree_kv_cache_size, self.worker, self.state)
                self.worker.init_cache(self.kv_cache_size)
        except BaseException:
            self.shutdown()
            raise
        atexit.register(_shutdown_at_exit, weakref.ref(self))
        logger.info("%d ranks ready: tensor parallel %d x pipeline parallel %d",
                    self.world_size, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)

    def _launch(self, config: EngineConfig) -> tuple[str, int]:
        """Start ranks 1.. on this machine, or, under torchrun, become the rank torchrun says."""
        launched_world = int(os.environ.get("WORLD_SIZE", "1"))
        if launched_world > 1:
            if config.parallel.distributed_executor_backend != "mp":
                raise ValueError("under torchrun the ranks are torchrun's: leave out --distributed-executor-backend")
            if launched_world != self.world_size:
                raise ValueError(f"torchrun started {launched_world} processes, but tensor x pipeline parallel "
                                 f"size is {self.world_size}")
            rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(launched_world)))
            if rank != 0:  # this process serves as a worker for the engine on rank 0, then ends
                run_worker(rank, config, "env://", local_rank, local_world)
                sys.exit(0)
            return "env://", local_world
        if config.parallel.distributed_executor_backend == "ray":
            return self._launch_on_ray(config)
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        for rank in range(1, self.world_size):
            self.processes.append(start_rank(RankArgs(config, rank, init_method, rank, self.world_size)))
        return init_method, self.world_size

    def _launch_on_ray(self, config: EngineConfig) -> tuple[str, int]:
        from kvforge.executor import ray_ranks

        connected = ray_ranks.connect(config.parallel.ray_address)
        try:
            on_gpu = rank_device(config.device, 0).type == "cuda"
            init_method, self.processes, group = ray_ranks.start_ray_ranks(config, on_gpu)
        except BaseException:
            if connected:
                import ray

                ray.shutdown()
            raise
        self._ray_group = (group, connected)
        return init_method, config.parallel.tensor_parallel_size

    # ---- failure handling -------------------------------------------------------------------
    def _dead_ranks(self) -> list[str]:
        return [f"rank {rank} (pid {p.pid}) exited with code {p.returncode}"
                for rank, p in enumerate(self.processes, start=1) if p.poll() is not None]

    def _while_ranks_alive(self, fn):
        """Run a blocking rendezvous in a thread; fail as soon as a local rank dies instead of waiting."""
        outcome: list = []
        thread = threading.Thread(target=lambda: outcome.append(_capture(fn)), daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            dead = self._dead_ranks()
            if dead:
                raise RuntimeError(f"a worker died while the ranks were starting: {'; '.join(dead)}")
        result, error = outcome[0]
        if error is not None:
            raise error
        return result

    def _guarded(self, fn, *args):
        """Run a step's communication; a broken connection becomes an error that names the dead rank."""
        if self._closed:
            raise RuntimeError("the distributed engine has shut down (a worker failed or shutdown() was called)")
        try:
            return fn(*args)
        except RuntimeError as err:
            deadline = time.monotonic() + 2.0
            while not self._dead_ranks() and self.processes and time.monotonic() < deadline:
                time.sleep(0.05)
            dead = "; ".join(self._dead_ranks()) or "a rank failed"
            self.shutdown()
            raise RuntimeError(f"distributed engine failed: {dead} ({err})") from err

    # ---- steps ------------------------------------------------------------------------------
    def _broadcast(self, kind: str, output: SchedulerOutput | RankProfiler | None) -> None:
        for rank in range(1, self.world_size):
            send_object(self.state, (kind, output), rank, TAG_COMMAND)

    def start_profile(self, profiler: RankProfiler) -> None:
        """Every other rank's worker records its batches with (its copy of) profiler, from its next command on."""
        self._guarded(self._broadcast, _START_PROFILE, profiler)

    def stop_profile(self) -> None:
        """Every other rank's worker stops its profiler, which writes out what it recorded."""
        self._guarded(self._broadcast, _STOP_PROFILE, None)

    def _step(self, output: SchedulerOutput) -> ModelRunnerOutput | None:
        self._broadcast(_EXECUTE, output)
        return self.worker.execute(output)

    def submit(self, output: SchedulerOutput) -> None:
        self._results.append(self._guarded(self._step, output))

    def collect(self) -> ModelRunnerOutput:
        local = self._results.popleft()
        if self.state.sampler_rank == 0:
            return local
        return self._guarded(recv_object, self.state, self.state.sampler_rank, TAG_RESULT)

    def _score(self, output: SchedulerOutput) -> torch.Tensor:
        self._broadcast(_SCORE, output)
        local = self.worker.score(output)
        return local if self.state.sampler_rank == 0 else recv_object(self.state, self.state.sampler_rank, TAG_RESULT)

    def score(self, output: SchedulerOutput) -> torch.Tensor:
        return self._guarded(self._score, output)

    def __del__(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        alive = [rank for rank, p in enumerate(self.processes, start=1) if p.poll() is None]
        try:
            if not self._dead_ranks() and hasattr(self, "state"):
                self._broadcast(_SHUTDOWN, SchedulerOutput())
                wait_for_sends()
        except RuntimeError:
            forget_sends()  # a rank is gone already; the others are stopped below
        for rank in alive:
            try:
                self.processes[rank - 1].wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        forget_sends()
        leave_world()
        if self._ray_group is not None:
            from kvforge.executor.ray_ranks import release

            release(*self._ray_group)
        torch.set_num_threads(self._num_threads)
        if hasattr(self, "worker"):
            super().shutdown()


def _shutdown_at_exit(executor: weakref.ref[DistributedExecutor]) -> None:
    if executor() is not None:
        executor().shutdown()


def _capture(fn) -> tuple[object, BaseException | None]:
    try:
        return fn(), None
    except BaseException as err:  # handed to the waiting thread, which raises it
        return None, err
