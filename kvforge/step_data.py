"""The data a step carries between the engine and the executor, both ways: plain dataclasses that import nothing of
the engine, the executor or torch, so either side may import them and neither imports the other for them.

    engine (Scheduler)  --SchedulerOutput / PoolingStep-->  executor (ModelRunner, PoolingRunner), ranks
    engine              <--ModelRunnerOutput--------------  executor
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvforge.layers.sampler import RawLogprobs
    from kvforge.lora.request import LoRARequest
    from kvforge.pooling_params import PoolingParams
    from kvforge.sampling_params import SamplingParams
    from kvforge.structured_output.bitmask import GrammarBitmask


@dataclass(slots=True)
class NewRequest:
    """Sent to the runner once, when a request enters the running batch (again, after a preemption):
    what it keeps for the request until the request finishes or is preempted."""

    request_id: str
    token_ids: list[int]  # the prompt and the tokens generated so far (a copy)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    lora: LoRARequest | None = None  # the adapter it runs with (None: the base model)


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute token_ids at positions num_computed_tokens onwards.

    Only what changed since the request's previous step travels: its new tokens and the blocks its
    table gained (the whole table in the step that sends it as a NewRequest)."""

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    new_block_ids: list[list[int]]  # per layer group of the KV cache (one for a model of uniform layers)
    num_prompt_tokens: int
    needs_sample: bool
    banned_token_ids: list[int]  # stop tokens the sampler must not pick before min_tokens
    num_draft_tokens: int = 0  # the last num_draft_tokens of token_ids are drafts to verify
    propose_drafts: bool = False  # the runner proposes drafts to follow what the request samples this step
    # a hybrid model's linear-attention state checkpoints (engine/state_checkpoints.py): the one the request's state
    # slot takes before the step (a prefix-cache hit), and the one that takes a copy of the slot after it
    load_state_from: int | None = None
    save_state_to: int | None = None


@dataclass(slots=True)
class SchedulerOutput:
    """Plain data for the model runner: the requests it meets for the first time, what to compute this
    step, and which requests are gone (finished, aborted or preempted: the runner forgets them)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # the allowed tokens of the constrained requests that sample this step (set by the engine)
    grammar_bitmask: GrammarBitmask | None = None
    reset_proposer: bool = False  # the runner's draft proposer forgets the finished requests first

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)


@dataclass(slots=True)
class PoolingStep:
    """Plain data for the pooling runner: the inputs it runs together, each whole."""

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    token_type_ids: list[list[int] | None] = field(default_factory=list)  # None: every token of type 0
    params: list[PoolingParams] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


@dataclass(slots=True)
class ModelRunnerOutput:
    """Plain data back to the engine: the tokens each finished-prefill/decode request appends this step
    (one, or the accepted drafts and one more when speculating), applied by Scheduler.update_from_output;
    the logprobs of each of them where asked; when speculating, the drafts the runner proposes to follow them
    (verified in the request's next step)."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # (requests without drafts: absent)
    logprobs: dict[str, list[RawLogprobs]] = field(default_factory=dict)
    # request id -> (index of the first prompt token predicted, logprobs of the tokens predicted)
    prompt_logprobs: dict[str, tuple[int, list[RawLogprobs]]] = field(default_factory=dict)
    warmup: bool = False  # the step ran eagerly before its bucket compiled, or beside a compile: untypically slow
