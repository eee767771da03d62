"""GrammarBitmask: the allowed next tokens of a step's constrained requests, as plain numpy data."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvforge.structured_output.matcher import GrammarMatcher


@dataclass(slots=True)
class GrammarBitmask:
    """Row i says which tokens request_ids[i] may sample next: bit j of word k allows token 32 k + j.

    Built on the engine side from the requests' matchers, shipped with the step to the runner, which
    applies it to the logits on the device before any other sampling transform."""

    request_ids: list[str]
    bitmask: np.ndarray  # [len(request_ids), ceil(vocab / 32)] int32

    @classmethod
    def build(cls, matchers: Iterable[tuple[str, GrammarMatcher]], num_words: int) -> GrammarBitmask | None:
        """The bitmask of the (request id, matcher) pairs given; None when there are none."""
        pairs = list(matchers)
        if not pairs:
            return None
        bitmask = np.full((len(pairs), num_words), -1, dtype=np.int32)
        for row, (_, matcher) in enumerate(pairs):
            matcher.fill_bitmask(bitmask, row)
        return cls([request_id for request_id, _ in pairs], bitmask)
