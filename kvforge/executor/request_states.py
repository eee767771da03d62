"""What the model runner keeps for each request between steps, so a step carries only what changed.

The scheduler sends a request's prompt, generated tokens and sampling parameters once (a NewRequest,
when it enters the running batch), then per step only the tokens to compute and the blocks its table
gained. The runner forgets a request when it finishes, is aborted or is preempted (a preempted request
comes back as a NewRequest).

    token_ids     prompt + generated, up to the end of the latest scheduled chunk:
                  [p0 p1 ... p(n-1) | o0 o1 ... ]   overwritten from num_computed_tokens onwards each step
    block_tables  per layer group, append-only: each step extends them with the step's new_block_ids

A seeded request's generator outlives a preemption (it is dropped when the request finishes), so its
samples do not depend on whether it was preempted. The other requests draw from the engine's generator
(`engine_generator`, seeded with the engine's seed), never from torch's global one: two engines in one process
do not draw from (or reseed) each other's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.lora.request import LoRARequest
from kvforge.sampling_params import SamplingParams
from kvforge.step_data import ScheduledRequest, SchedulerOutput


@dataclass(slots=True)
class RequestState:
    """One request as the runner knows it."""

    token_ids: list[int]
    num_prompt_tokens: int
    block_tables: list[list[int]]  # per layer group of the KV cache
    sampling_params: SamplingParams
    generator: torch.Generator | None
    lora: LoRARequest | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.output_token_ids_before(0)

    def output_token_ids_before(self, num_draft_tokens: int) -> list[int]:
        """The generated tokens without the latest step's last num_draft_tokens (drafts still to verify)."""
        return self.token_ids[self.num_prompt_tokens : len(self.token_ids) - num_draft_tokens]

    def advance(self, scheduled: ScheduledRequest) -> None:
        """Apply one step's share: its tokens replace whatever followed its first position."""
        start = scheduled.num_computed_tokens
        assert start <= len(self.token_ids), "a step starts past the tokens the runner holds"
        del self.token_ids[start:]
        self.token_ids.extend(scheduled.token_ids)
        if not self.block_tables:
            self.block_tables = [[] for _ in scheduled.new_block_ids]
        for table, new_block_ids in zip(self.block_tables, scheduled.new_block_ids, strict=True):
            table.extend(new_block_ids)


class RequestStates:
    """The runner's requests by id; `update(output)` applies a step's changes before it runs."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.engine_generator = torch.Generator(device).manual_seed(seed)
        self.states: dict[str, RequestState] = {}
        self.generators: dict[str, torch.Generator] = {}

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, request_id: str) -> RequestState:
        return self.states[request_id]

    def update(self, output: SchedulerOutput) -> None:
        self.forget(output.finished_request_ids)
        for request_id in output.preempted_request_ids:
            self.states.pop(request_id, None)
        for new in output.new_requests:
            seed, request_id = new.sampling_params.seed, new.request_id
            if seed is not None and request_id not in self.generators:
                self.generators[request_id] = torch.Generator(self.device).manual_seed(seed)
            self.states[request_id] = RequestState(list(new.token_ids), new.num_prompt_tokens, [],
                                                   new.sampling_params, self.generators.get(request_id), new.lora)
        for scheduled in output.scheduled:
            self.states[scheduled.request_id].advance(scheduled)

    def forget(self, request_ids: list[str]) -> None:
        """Drop finished requests (and their generators)."""
        for request_id in request_ids:
            self.states.pop(request_id, None)
            self.generators.pop(request_id, None)
