"""The pooling runner's executor: one device, the model in the engine's process, no KV cache."""

from __future__ import annotations

import torch

from kvforge.config import EngineConfig
from kvforge.executor.device import resolve_device
from kvforge.executor.pooling_runner import PoolingRunner
from kvforge.executor.worker import load_with_ops
from kvforge.loader.model_loader import LoadedModel
from kvforge.step_data import PoolingStep


class PoolingExecutor:
    """Loads the pooling model (runner "pooling") on the engine's device and runs its steps; `shutdown` releases
    it."""

    def __init__(self, config: EngineConfig) -> None:
        parallel = config.parallel
        if parallel.world_size > 1:
            raise ValueError(f"the pooling runner runs on one device: tensor_parallel_size="
                             f"{parallel.tensor_parallel_size} and pipeline_parallel_size="
                             f"{parallel.pipeline_parallel_size} must be 1")
        self.device = resolve_device(config.device)
        self.ops, loaded = load_with_ops(config, self.device, runner="pooling")
        self.loaded: LoadedModel | None = loaded
        self.runner: PoolingRunner | None = PoolingRunner(loaded.model, loaded.pooler, self.device, loaded.dtype)

    @property
    def model(self) -> torch.nn.Module:
        return self.loaded.model

    def execute(self, step: PoolingStep) -> list[torch.Tensor]:
        return self.runner.execute(step)

    def shutdown(self) -> None:
        self.runner = None
        self.loaded = None
