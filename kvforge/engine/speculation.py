"""The scheduler's side of speculative decoding: which drafts a decoding request carries into a step, and
how many of them the model accepted.

The runner proposes each sampling request's drafts for its next step after sampling (n-gram, suffix: one call for
the step's requests, on the tokens the runner holds) and returns them with the sampled tokens; `take` keeps them
until the request is scheduled again. A draft model drafts in the runner too (executor/draft_runner.py), keeping
the distributions it sampled from there; its requests' steps allocate lookahead slots for its own drafts' keys and
values."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvforge.engine.request import Request
from kvforge.engine.stats import SpecDecodeStats
from kvforge.spec_decode.policy import SpeculationPolicy


class Speculation:
    """Hands each decoding request the drafts proposed for it, as many as the policy plans for the step and
    within the step's token budget and the request's length limits (every draft accepted plus the model's own
    token never pass max_tokens or the model length), and counts drafts and accepted drafts per position.

    lookahead: the slots past a proposing request's step that the runner's proposer writes (the draft model's
    keys and values of its drafts; 0 without a model)."""

    def __init__(self, policy: SpeculationPolicy, lookahead: int = 0) -> None:
        self.policy = policy
        self.lookahead = lookahead
        num_speculative_tokens = policy.num_speculative_tokens
        self.num_drafted_per_position = [0] * num_speculative_tokens
        self.num_accepted_per_position = [0] * num_speculative_tokens
        self.num_verified_requests = 0  # request-steps that verified at least one draft
        self.planned: dict[str, int] = {}
        self.proposed: dict[str, list[int]] = {}  # request id -> the runner's drafts to follow its tokens now
        self.reset_pending = False  # the runner's proposer is to forget the finished requests (at the next step)

    def plan(self, decoding: Sequence[Request]) -> None:
        """Before a step's drafts: the requests that decode in it."""
        self.planned = self.policy.plan([r.request_id for r in decoding])

    def wants_drafts(self, request: Request) -> bool:
        """Whether the runner is to propose drafts after the request's step: unless the latest plan gave it none and
        it does not probe soon (proposing costs host time per request; at speculative_max_rows decoding requests
        nobody drafts)."""
        planned = self.planned.get(request.request_id)
        return planned is None or planned > 0 or self.policy.probes_soon(request.request_id)

    def take(self, request_id: str, draft_token_ids: Mapping[str, list[int]]) -> None:
        """The request appended a step's sampled tokens; draft_token_ids: the runner's drafts to follow them."""
        drafts = draft_token_ids.get(request_id)
        if drafts:
            self.proposed[request_id] = drafts
        else:
            self.proposed.pop(request_id, None)

    def drafts(self, request: Request, budget: int) -> list[int]:
        """Draft tokens to follow a request that decodes this step (its one new token takes 1 of budget)."""
        limit = min(self.planned.get(request.request_id, 0), budget - 1,
                    request.max_total_tokens - request.num_tokens - 1)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - request.num_output_tokens - 1)
        if limit <= 0:
            return []
        return self.proposed.get(request.request_id, [])[:limit]

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A request verified num_drafts drafts and accepted the first num_accepted."""
        if num_drafts == 0:
            return
        self.policy.record(request_id, num_drafts, num_accepted)
        self.num_verified_requests += 1
        for position in range(num_drafts):
            self.num_drafted_per_position[position] += 1
            self.num_accepted_per_position[position] += position < num_accepted

    def record_step(self, num_rows: int, seconds: float) -> None:
        """A decode-only step of num_rows token rows (decodes and their drafts) took seconds, start to end."""
        self.policy.costs.record(num_rows, seconds)

    def preempt(self, request: Request) -> None:
        """The request is recomputed from its first token: the drafts proposed for it wait for its next sample."""
        self.proposed.pop(request.request_id, None)

    def finish(self, request: Request) -> None:
        """The request is gone (the runner's proposer hears of it with the step's finished request ids)."""
        self.policy.forget(request.request_id)
        self.proposed.pop(request.request_id, None)

    def reset(self) -> None:
        """Forget what finished requests taught the runner's proposer, at the next step (take_reset)."""
        self.reset_pending = True

    def take_reset(self) -> bool:
        """Whether the runner's proposer is to reset before the step being scheduled (once per reset)."""
        pending, self.reset_pending = self.reset_pending, False
        return pending

    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_verified_requests, tuple(self.num_drafted_per_position),
                               tuple(self.num_accepted_per_position))
