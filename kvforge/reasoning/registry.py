"""The reasoning parsers by the name `--reasoning-parser` takes, and whether a request expects reasoning."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvforge.reasoning.parser import ReasoningParser

REASONING_PARSERS: dict[str, ReasoningParser] = {
    # Qwen3: the model opens its reasoning with <think> itself, or writes none
    "qwen3": ReasoningParser(),
    # DeepSeek-R1: the chat template may end the prompt with <think>, so the reply starts inside the reasoning
    "deepseek_r1": ReasoningParser(starts_in_reasoning=True),
}
# Chat template arguments that turn a model's reasoning off (Qwen3's and DeepSeek's templates read them)
_THINKING_SWITCHES = ("enable_thinking", "thinking")


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser of that name; ValueError naming the choices for another."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; the parsers are {sorted(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]


def expects_reasoning(chat_template_kwargs: Mapping[str, Any] | None) -> bool:
    """False when the request turns thinking off (`enable_thinking: false`): its reply is all content."""
    kwargs = chat_template_kwargs or {}
    return not any(kwargs.get(switch) is False for switch in _THINKING_SWITCHES)
