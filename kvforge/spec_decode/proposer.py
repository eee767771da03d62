"""What the runner's proposers of draft tokens without a model (n-gram, suffix) offer: drafts for every request of a
step in one call, from the tokens the runner holds (the draft model drafts in the runner too:
executor/draft_runner.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvforge.config import SpeculativeConfig


class Proposer(Protocol):
    """Proposes draft tokens for a batch of requests after a step; the target model verifies them in the next.

    propose: per request (its id and its tokens so far, prompt and output), up to max_num_tokens drafts to
    follow them, possibly none. finish: the request is gone (token_ids: its final tokens, empty where the runner
    no longer held them); forget its state. reset: forget what finished requests left behind (between benchmark
    rounds, or when the traffic changes). A proposer that keeps state per request sees each request's tokens only
    grow between calls, except after finish."""

    def propose(self, requests: Sequence[tuple[str, Sequence[int]]], max_num_tokens: int) -> list[list[int]]: ...

    def finish(self, request_id: str, token_ids: Sequence[int]) -> None: ...

    def reset(self) -> None: ...


def create_proposer(spec: SpeculativeConfig) -> Proposer | None:
    """The runner's proposer of the configured method (None: speculation off, or drafts from a draft model, which
    the runner runs: executor/draft_runner.py)."""
    from kvforge.spec_decode.ngram import NgramProposer
    from kvforge.spec_decode.suffix import SuffixProposer

    if spec.speculative_method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.speculative_method == "suffix":
        return SuffixProposer(min_token_prob=spec.suffix_min_token_prob)
    return None
