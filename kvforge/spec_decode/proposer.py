"""What the proposers of draft tokens offer: the runner's (n-gram, suffix), which draft for every request of a step in
one call from the tokens the runner holds, and the draft model's, which the scheduler asks one request at a time."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from kvforge.config import SpeculativeConfig
    from kvforge.sampling_params import SamplingParams


@dataclass(slots=True)
class Drafts:
    """Draft token ids and, from proposers that sample them, the distribution each was drawn from
    (probs [len(token_ids), vocab] float32, rows summing to 1; None: each draft counts as one-hot)."""

    token_ids: list[int]
    probs: np.ndarray | None = None

    def truncated(self, num_tokens: int) -> Drafts:
        if len(self.token_ids) <= num_tokens:
            return self
        return Drafts(self.token_ids[:num_tokens], None if self.probs is None else self.probs[:num_tokens])


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


class RequestProposer(Protocol):
    """The draft model's proposer, asked by the scheduler for one request's drafts at a time (with the
    distributions they were sampled from); shutdown releases its engine."""

    def propose(self, request_id: str, token_ids: Sequence[int], max_num_tokens: int,
                sampling_params: SamplingParams | None = None) -> Drafts: ...

    def finish(self, request_id: str, token_ids: Sequence[int]) -> None: ...

    def reset(self) -> None: ...

    def shutdown(self) -> None: ...


def create_proposer(spec: SpeculativeConfig) -> Proposer | None:
    """The runner's proposer of the configured method (None: speculation off, or drafts from a draft model, which
    the scheduler asks: spec_decode/draft.py)."""
    from kvforge.spec_decode.ngram import NgramProposer
    from kvforge.spec_decode.suffix import SuffixProposer

    if spec.speculative_method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.speculative_method == "suffix":
        return SuffixProposer(min_token_prob=spec.suffix_min_token_prob)
    return None
