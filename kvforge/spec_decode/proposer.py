"""What every proposer of draft tokens offers the scheduler."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from kvforge.config import EngineConfig
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
    """Proposes draft tokens to follow a request's tokens; the target model verifies them in the next step.

    propose: up to max_num_tokens drafts to follow token_ids (the request's prompt and output so far),
    possibly none; sampling_params: the request's, for proposers that sample their drafts. finish: the
    request is gone (its tokens are final); forget its state. reset: forget what finished requests left
    behind (between benchmark rounds, or when the traffic changes). shutdown: release what the proposer holds
    (a draft model's engine); it proposes nothing afterwards. Proposers that keep state per request see
    each request's tokens only grow between calls, except after finish."""

    def propose(self, request_id: str, token_ids: Sequence[int], max_num_tokens: int,
                sampling_params: SamplingParams | None = None) -> Drafts: ...

    def finish(self, request_id: str, token_ids: Sequence[int]) -> None: ...

    def reset(self) -> None: ...

    def shutdown(self) -> None: ...


def create_proposer(config: EngineConfig, vocab_size: int) -> Proposer | None:
    """The proposer of the configured method (None: speculation off)."""
    from kvforge.spec_decode.draft import DraftModelProposer
    from kvforge.spec_decode.ngram import NgramProposer
    from kvforge.spec_decode.suffix import SuffixProposer

    spec = config.speculative
    if spec.speculative_method is None:
        return None
    if spec.speculative_method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.speculative_method == "suffix":
        return SuffixProposer(min_token_prob=spec.suffix_min_token_prob)
    return DraftModelProposer(config, vocab_size)
