"""GrammarMatcher: one request's position in its grammar, advanced by accepted tokens."""

from __future__ import annotations

import llguidance
import llguidance.numpy
import numpy as np


class GrammarMatcher:
    """Where one request stands in its grammar: which tokens may come next, and whether it may end.

    `advance` takes the tokens a step accepted (several when speculating) and `rollback` undoes the
    last ones (rejected draft tokens). EOS is in the allowed set exactly when the grammar is complete.
    """

    __slots__ = ("_matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def advance(self, token_ids: list[int]) -> int:
        """Accept token_ids in order, up to the first the grammar does not allow; returns how many."""
        return self._matcher.try_consume_tokens(list(token_ids))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens."""
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._matcher.get_error()}")

    @property
    def is_complete(self) -> bool:
        """The output so far is a whole sentence of the grammar (it may end here)."""
        return self._matcher.is_accepting()

    @property
    def is_terminated(self) -> bool:
        """Nothing but the end of the output can follow."""
        return self._matcher.is_stopped()

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (bit j of word k: token 32 k + j)."""
        llguidance.numpy.fill_next_token_bitmask(self._matcher, bitmask, row)
