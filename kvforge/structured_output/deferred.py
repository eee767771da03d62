"""DeferredMatcher: a grammar that starts once the output has written a marker, such as the end of its reasoning.

    <think> free text, any token ... </think>{"city": "Paris"}
    |------------- unconstrained -----------||-- the grammar --|
                          the token that completes the marker ^

Before the marker every token is allowed (the bitmask row stays all ones) and each token's text is kept to
find the marker, which may span tokens; the tokens after the one that completes it go to the grammar.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvforge.structured_output.matcher import GrammarMatcher


class DeferredMatcher:
    """A GrammarMatcher armed once the output's text contains `marker` (see the module's docstring)."""

    __slots__ = ("_matcher", "_marker", "_token_text", "_pieces", "_num_armed_tokens")

    def __init__(self, matcher: GrammarMatcher, marker: str, token_text: Callable[[int], str]) -> None:
        if not marker:
            raise ValueError("the marker that starts a grammar must be non-empty")
        self._matcher = matcher
        self._marker = marker
        self._token_text = token_text
        self._pieces: list[str] = []  # the text of each token up to the one that completes the marker
        self._num_armed_tokens: int | None = None  # tokens the grammar took; None until the marker is written

    @property
    def is_armed(self) -> bool:
        return self._num_armed_tokens is not None

    def advance(self, token_ids: list[int]) -> int:
        """Accept token_ids in order (any before the marker), up to the first the grammar does not allow."""
        for count, token_id in enumerate(token_ids):
            if self._num_armed_tokens is not None:
                accepted = self._matcher.advance(token_ids[count:])
                self._num_armed_tokens += accepted
                return count + accepted
            self._pieces.append(self._token_text(token_id))
            if self._marker_ends_here():
                self._num_armed_tokens = 0
        return len(token_ids)

    def _marker_ends_here(self) -> bool:
        """Whether the marker ends in the last piece (it may begin in earlier ones)."""
        wanted = len(self._marker) - 1 + len(self._pieces[-1])
        tail, index = self._pieces[-1], len(self._pieces) - 1
        while len(tail) < wanted and index > 0:
            index -= 1
            tail = self._pieces[index] + tail
        return self._marker in tail

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens, back before the marker if need be."""
        num_armed = self._num_armed_tokens or 0
        if not 0 <= num_tokens <= num_armed + len(self._pieces):
            raise ValueError(f"cannot roll back {num_tokens} tokens of {num_armed + len(self._pieces)}")
        self._matcher.rollback(min(num_tokens, num_armed))
        num_before = num_tokens - min(num_tokens, num_armed)
        if self._num_armed_tokens is not None:
            self._num_armed_tokens -= num_tokens - num_before
        if num_before:  # the marker's last token goes first: the text before it does not hold the marker
            del self._pieces[len(self._pieces) - num_before:]
            self._num_armed_tokens = None

    @property
    def is_complete(self) -> bool:
        return self.is_armed and self._matcher.is_complete

    @property
    def is_terminated(self) -> bool:
        return self.is_armed and self._matcher.is_terminated

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        if self.is_armed:
            self._matcher.fill_bitmask(bitmask, row)
