"""ReasoningParser: a reply split into its reasoning, between a start and an end tag, and its content after.

    <think>The user wants the weather.</think>\n\n{"city": "Paris"}
    ^^^^^^^ ---------- reasoning ---------^^^^^^^^^^^^^^ content ^^^^
      tag                                   tag   (leading whitespace dropped)

A model whose chat template already opens the reasoning in the prompt (`starts_in_reasoning`) writes no
start tag: its reply begins inside the reasoning. Otherwise the reply has reasoning only when it begins
with the start tag; a reply without it is all content. Reasoning that never ends is all reasoning.

`split` reads the text generated so far. While the reply runs (`finished` false) it holds back what may
still turn out to be a tag, so what it returns for a prefix of a reply is always a prefix of what it
returns for the whole reply: a stream sends the growth of each part and never shows a tag.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReasoningSplit:
    """The reasoning (None: the reply has none) and the content of a reply, or of its prefix."""

    reasoning: str | None
    content: str


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    """How one model family marks its reasoning (see the module's docstring)."""

    start: str = "<think>"
    end: str = "</think>"
    starts_in_reasoning: bool = False
    special_tokens: tuple[str, ...] = ()  # tags that are special tokens, which the reply's text must keep

    def split(self, text: str, finished: bool) -> ReasoningSplit:
        """The reasoning and content of text; while not finished, without what may still become a tag."""
        lead = text.lstrip()
        if lead.startswith(self.start):
            body = lead[len(self.start):]
        elif not finished and self.start.startswith(lead):  # may still become the start tag
            return ReasoningSplit(None, "")
        elif self.starts_in_reasoning:
            body = text
        else:
            return ReasoningSplit(None, text)
        reasoning, found, rest = body.partition(self.end)
        if found:
            return ReasoningSplit(reasoning, rest.lstrip())
        if not finished:
            reasoning = reasoning[: len(reasoning) - partial_suffix(reasoning, self.end)]
        return ReasoningSplit(reasoning, "")


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that is a proper beginning of tag."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
