"""The scheduler's side of speculative decoding: which drafts a decoding request carries into a step, and
how many of them the model accepted."""

from __future__ import annotations

from collections.abc import Sequence

from kvforge.engine.request import Request
from kvforge.engine.stats import SpecDecodeStats
from kvforge.spec_decode.policy import SpeculationPolicy
from kvforge.spec_decode.proposer import Drafts, Proposer


class Speculation:
    """Asks the proposer for each decoding request's drafts, as many as the policy plans for the step and
    within the step's token budget and the request's length limits (every draft accepted plus the model's own
    token never pass max_tokens or the model length), and counts drafts and accepted drafts per position."""

    def __init__(self, proposer: Proposer, policy: SpeculationPolicy) -> None:
        self.proposer = proposer
        self.policy = policy
        num_speculative_tokens = policy.num_speculative_tokens
        self.num_drafted_per_position = [0] * num_speculative_tokens
        self.num_accepted_per_position = [0] * num_speculative_tokens
        self.num_verified_requests = 0  # request-steps that verified at least one draft
        self.planned: dict[str, int] = {}

    def plan(self, decoding: Sequence[Request]) -> None:
        """Before a step's drafts: the requests that decode in it."""
        self.planned = self.policy.plan([r.request_id for r in decoding])

    def drafts(self, request: Request, budget: int) -> Drafts:
        """Draft tokens to follow a request that decodes this step (its one new token takes 1 of budget)."""
        limit = min(self.planned.get(request.request_id, 0), budget - 1,
                    request.max_total_tokens - request.num_tokens - 1)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - request.num_output_tokens - 1)
        if limit <= 0:
            return Drafts([])
        return self.proposer.propose(request.request_id, request.all_token_ids, limit,
                                     request.sampling_params).truncated(limit)

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

    def finish(self, request: Request) -> None:
        self.policy.forget(request.request_id)
        self.proposer.finish(request.request_id, request.all_token_ids)

    def reset(self) -> None:
        self.proposer.reset()

    def shutdown(self) -> None:
        self.proposer.shutdown()

    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_verified_requests, tuple(self.num_drafted_per_position),
                               tuple(self.num_accepted_per_position))
