"""HarmonyParser: GPT-OSS's replies, messages on channels, split into reasoning and content.

A reply (its special tokens kept) is one or more messages; the first one's `<|start|>assistant` is in the prompt:

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>
                      ^^^^ header ^^^^^^^^^^^^^^^^ ^^^ body ^^ ^^ end ^^
or, for a tool call, after the analysis:
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "P"}<|call|>

The analysis channel's bodies are the reasoning; the final channel's (and commentary to the user) the content. A
message to a function is a tool call: it goes into the content written as CALL_HEADER + name + CALL_ARGUMENTS +
arguments, the form server/tool_formats.HARMONY reads (a recipient written before the channel comes out the same).
The end token of the last message is an end of generation, so it is not in the text. A reply that starts with no
header is all content (a model that does not write harmony). While the reply runs, a header not yet whole is held
back, so the parts of a prefix of a reply are prefixes of the whole reply's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvforge.reasoning.parser import ReasoningSplit, partial_suffix

SPECIAL_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
CALL_HEADER = "<|channel|>commentary to=functions."
CALL_ARGUMENTS = " <|constrain|>json<|message|>"
_HEADER = re.compile(r"(?:<\|start\|>assistant)?(?: to=(?P<before>[^\s<]+))?<\|channel\|>(?P<channel>\w+)"
                     r"(?: to=(?P<after>[^\s<]+))?(?:\s*(?:<\|constrain\|>)?\s*[^\s<]+)?<\|message\|>")
_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_END = re.compile("|".join(map(re.escape, _ENDS)))
_HEADER_STARTS = ("<|start|>", "<|channel|>", " to=")


@dataclass(frozen=True, slots=True)
class HarmonyParser:
    """The harmony reply format (see the module's docstring). end is None: a constraint is not started after the
    reasoning but written around it (tool_formats.HARMONY's grammar lets an analysis message come first)."""

    end: None = None
    special_tokens: tuple[str, ...] = SPECIAL_TOKENS

    def split(self, text: str, finished: bool) -> ReasoningSplit:
        reasoning: list[str] = []
        content: list[str] = []
        position = 0
        while position < len(text):
            header = _HEADER.match(text, position)
            if header is None:
                rest = text[position:]
                if finished or not _may_become_header(rest):
                    content.append(rest)
                break
            body_end = _END.search(text, header.end())
            body = text[header.end(): len(text) if body_end is None else body_end.start()]
            if body_end is None and not finished:  # what may still become an end token is held back
                body = body[: len(body) - max(partial_suffix(body, end) for end in _ENDS)]
            recipient = header["before"] or header["after"] or ""
            if header["channel"] == "analysis":
                reasoning.append(body)
            elif recipient.startswith("functions."):
                content.append(f"{CALL_HEADER}{recipient.removeprefix('functions.')}{CALL_ARGUMENTS}{body}")
            else:
                content.append(body)
            if body_end is None:
                break
            position = body_end.end()
        return ReasoningSplit("".join(reasoning) if reasoning else None, "".join(content))


def _may_become_header(text: str) -> bool:
    return any(text.startswith(start) or start.startswith(text) for start in _HEADER_STARTS)
