"""Incremental detokenization with stop strings matched across token boundaries."""

from __future__ import annotations

from kvforge.tokenizer import Tokenizer

_CONTEXT_TOKENS = 5  # prompt tokens decoded alongside the output so leading spaces come out right


class IncrementalDetokenizer:
    """Turns one request's output tokens into text, a few characters at a time.

    Each new token is decoded together with the tokens since the last emitted boundary; text is
    emitted only once it no longer ends in an incomplete UTF-8 character (U+FFFD), so a
    multi-byte character split over several byte tokens is never cut in half.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool,
                 stop: list[str], include_stop_str_in_output: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        # While running, hold back as many characters as a stop string could still claim.
        self.holdback = max((len(s) for s in stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str | None:
        """Append one token; returns the stop string if the text now contains one (text cut before it)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return None
        delta = full_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        search_from = max(len(self.text) - self.holdback, 0)
        self.text += delta
        hits = [(index, stop) for stop in self.stop if (index := self.text.find(stop, search_from)) != -1]
        if not hits:
            return None
        index, stop = min(hits)
        self.text = self.text[: index + len(stop) if self.include_stop else index]
        return stop

    def visible_text(self, finished: bool) -> str:
        """The text safe to show: all of it once finished, else without a possible stop-string start."""
        if finished or not self.stop:
            return self.text
        return self.text[: max(len(self.text) - self.holdback, 0)]
