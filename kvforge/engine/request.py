"""One sequence being generated: its tokens, its progress through the model and its outputs."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvforge.lora.request import LoRARequest
from kvforge.sampling_params import SamplingParams
from kvforge.structured_output.deferred import DeferredMatcher
from kvforge.structured_output.matcher import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


@dataclass(slots=True, eq=False)
class Request:
    """A sequence: prompt plus generated tokens, and how many of them the KV cache holds.

    The one progress rule: `num_computed_tokens` catches up to `num_tokens`. A prefill, a prefill
    chunk, a prefix-cache hit, a decode and a recompute after preemption all just advance it; when
    it reaches `num_tokens`, the step samples the next token.

    A user request with n samples is n Requests of one group: `group_id` names the user request and
    `sample_index` the sample in it (the request id is only a unique key, never parsed). The
    scheduler owns the request's state; only `Scheduler.update_from_output` and its finishing code
    change it after it is added.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_total_tokens: int = 1 << 62
    group_id: str | None = None  # None: a request of its own (group of one)
    sample_index: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    ended_by_stop_token: bool = False  # the last output token is an EOS or stop token that finished the request
    first_token_time: float | None = None
    grammar: GrammarMatcher | DeferredMatcher | None = None  # the output's constraint, advanced per accepted token
    lora: LoRARequest | None = None  # the adapter it runs with (None: the base model)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_output_token(self, token_id: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop_token(self) -> RequestStatus | None:
        """The finish status implied by the last generated token and the length limits, if any."""
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens:
            last = self.output_token_ids[-1]
            if not params.ignore_eos and last in self.eos_token_ids:
                self.ended_by_stop_token = True
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason, self.ended_by_stop_token = last, True
                return RequestStatus.FINISHED_STOPPED
        if self.grammar is not None and self.grammar.is_terminated:  # nothing but EOS could follow
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.num_tokens >= self.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
