"""The scheduler's side of speculative decoding: which drafts a decoding request carries into a step, and
how many of them the model accepted."""

from __future__ import annotations

from kvforge.engine.request import Request
from kvforge.engine.stats import SpecDecodeStats
from kvforge.spec_decode.proposer import Proposer


class Speculation:
    """Asks the proposer for each decoding request's drafts, within the step's token budget and the
    request's length limits (every draft accepted plus the model's own token never pass max_tokens or the
    model length), and counts drafts and accepted drafts per position."""

    def __init__(self, proposer: Proposer, num_speculative_tokens: int, disable_batch_size: int) -> None:
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.disable_batch_size = disable_batch_size
        self.num_drafted_per_position = [0] * num_speculative_tokens
        self.num_accepted_per_position = [0] * num_speculative_tokens
        self.num_verified_requests = 0  # request-steps that verified at least one draft

    def active(self, num_running: int) -> bool:
        """Whether a step with num_running running requests speculates."""
        return num_running <= self.disable_batch_size

    def drafts(self, request: Request, budget: int) -> list[int]:
        """Draft tokens to follow a request that decodes this step (its one new token takes 1 of budget)."""
        limit = min(self.num_speculative_tokens, budget - 1, request.max_total_tokens - request.num_tokens - 1)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - request.num_output_tokens - 1)
        if limit <= 0:
            return []
        return self.proposer.propose(request.request_id, request.all_token_ids, limit)[:limit]

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """A request verified num_drafts drafts and accepted the first num_accepted."""
        if num_drafts == 0:
            return
        self.num_verified_requests += 1
        for position in range(num_drafts):
            self.num_drafted_per_position[position] += 1
            self.num_accepted_per_position[position] += position < num_accepted

    def finish(self, request: Request) -> None:
        self.proposer.finish(request.request_id, request.all_token_ids)

    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_verified_requests, tuple(self.num_drafted_per_position),
                               tuple(self.num_accepted_per_position))
