"""Executors: how the engine's steps reach the workers.

    in-process      one device: the engine calls its only worker directly
    distributed     tp x pp ranks: the engine's process is rank 0 and sends each step's
                    SchedulerOutput to every other rank (multiproc.py); workers never schedule

The engine submits steps and collects their results in order. With pipeline parallelism up to
pp_size steps are in flight at once (disjoint requests), so every stage has work.
"""

from __future__ import annotations

from collections import deque

import torch

from kvforge.config import EngineConfig
from kvforge.distributed.parallel_state import ParallelState
from kvforge.executor.device import resolve_device
from kvforge.executor.kv_cache_memory import KVCacheSize
from kvforge.executor.model_info import ModelInfo
from kvforge.executor.worker import RankProfiler, Worker, agree_kv_cache_size
from kvforge.lora.request import LoRARequest
from kvforge.step_data import ModelRunnerOutput, SchedulerOutput


class Executor:
    """The engine's handle on the workers. `worker` is the one in this process (rank 0)."""

    worker: Worker
    kv_cache_size: KVCacheSize  # agreed by every rank
    max_in_flight: int = 1  # steps that may be submitted before the oldest is collected

    @property
    def num_blocks(self) -> int:
        """Blocks of every rank's KV cache, the null block included."""
        return self.kv_cache_size.num_blocks

    @property
    def model_info(self) -> ModelInfo:
        """The loaded model as the engine needs to know it (from this process's worker)."""
        return self.worker.model_info

    @property
    def local_model(self) -> torch.nn.Module:
        """This process's share of the model (rank 0's), for tools and tests that read its weights."""
        return self.worker.model

    def kv_cache_bytes(self) -> int:
        """Bytes of this process's KV cache tensors."""
        return self.worker.kv_cache_bytes()

    def load_lora(self, lora: LoRARequest) -> None:
        """Read and check an adapter on this process's rank before a request uses it (the other ranks read theirs
        on its first step); ValueError naming a bad adapter."""
        self.worker.load_lora(lora)

    def start_profile(self, profiler: RankProfiler) -> None:
        """Every other rank's worker records its batches with profiler (Worker.start_profile) until stop_profile; the
        engine's own rank is profiled where the engine is stepped. In-process: there is no other rank."""

    def stop_profile(self) -> None:
        """Stop the other ranks' profilers (start_profile); each writes out what it recorded."""

    def submit(self, output: SchedulerOutput) -> None:
        raise NotImplementedError

    def collect(self) -> ModelRunnerOutput:
        """The result of the oldest submitted step (blocks until it is there)."""
        raise NotImplementedError

    def score(self, output: SchedulerOutput) -> torch.Tensor:
        """fp32 logits of every scheduled token; no step may be in flight."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Release this process's worker (its model, KV cache and compiled graphs) and stop the other ranks' (if
        any); the executor is unusable afterwards."""
        self.worker.shutdown()


class InProcessExecutor(Executor):
    """One device: the only worker lives in the engine's process."""

    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config, resolve_device(config.device))
        self.kv_cache_size = agree_kv_cache_size(self.worker, ParallelState())
        self.worker.init_cache(self.kv_cache_size)
        self._results: deque[ModelRunnerOutput] = deque()

    def submit(self, output: SchedulerOutput) -> None:
        self._results.append(self.worker.execute(output))

    def collect(self) -> ModelRunnerOutput:
        return self._results.popleft()

    def score(self, output: SchedulerOutput) -> torch.Tensor:
        return self.worker.score(output)


def create_executor(config: EngineConfig) -> Executor:
    """In-process for one rank; otherwise this process becomes rank 0 of a distributed world (the
    other ranks are started here, or by torchrun, which sets RANK and WORLD_SIZE). Under torchrun
    with a world of one, every process runs an engine of its own (data parallel)."""
    if config.parallel.world_size == 1:
        return InProcessExecutor(config)
    from kvforge.executor.multiproc import DistributedExecutor

    return DistributedExecutor(config)
