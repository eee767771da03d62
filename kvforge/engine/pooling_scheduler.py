"""Batching for pooling models: whole inputs, in arrival order, within one token budget per step.

A pooling request takes one step: its whole input runs at once (an encoder attends to every token of it), its
pooled output comes back, and nothing of it is kept. Each step takes the oldest waiting inputs while they fit
max_num_batched_tokens and max_num_seqs, so a long input never holds short ones back for more than a step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvforge.config import SchedulerConfig
from kvforge.engine.stats import SchedulerStats
from kvforge.pooling_params import PoolingParams
from kvforge.step_data import PoolingStep


@dataclass(slots=True)
class PoolingRequest:
    request_id: str
    token_ids: list[int]
    params: PoolingParams
    token_type_ids: list[int] | None = None  # a pair's token types, for a model that reads them (BERT)
    arrival_time: float = field(default_factory=time.monotonic)


class PoolingScheduler:
    """The waiting pooling requests, oldest first; `schedule` takes the next step's."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.waiting: dict[str, PoolingRequest] = {}  # in arrival order

    def add_request(self, request: PoolingRequest) -> None:
        if request.request_id in self.waiting:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.waiting[request.request_id] = request

    def abort_request(self, request_id: str) -> None:
        self.waiting.pop(request_id, None)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(num_running=0, num_waiting=len(self.waiting), num_preemptions=0)

    def schedule(self) -> PoolingStep:
        """The oldest requests that fit the step's token budget and sequence count (the oldest always goes, even
        alone past the budget: every input the engine accepted fits the model's window)."""
        step, budget = PoolingStep(), self.config.max_num_batched_tokens
        for request in self.waiting.values():
            num_tokens = len(request.token_ids)
            if step.request_ids and (num_tokens > budget or len(step.request_ids) >= self.config.max_num_seqs):
                break
            step.request_ids.append(request.request_id)
            step.token_ids.append(request.token_ids)
            step.token_type_ids.append(request.token_type_ids)
            step.params.append(request.params)
            budget -= num_tokens
        for request_id in step.request_ids:
            del self.waiting[request_id]
        return step
