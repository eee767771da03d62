"""The reasoning parsers by the name `--reasoning-parser` takes, and whether a request expects reasoning."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvforge.reasoning.harmony import HarmonyParser
from kvforge.reasoning.parser import ReasoningParser

REASONING_PARSERS: dict[str, ReasoningParser | HarmonyParser] = {
    # Qwen3: the model opens its reasoning with <think> itself, or writes none
    "qwen3": ReasoningParser(),
    # DeepSeek-R1: the chat template may end the prompt with <think>, so the reply starts inside the reasoning
    "deepseek_r1": ReasoningParser(starts_in_reasoning=True),
    # GPT-OSS: harmony's analysis channel (chosen without the option for a chat template that writes channels)
    "openai_gptoss": HarmonyParser(),
}
# Chat template arguments that turn a model's reasoning off (Qwen3's and DeepSeek's templates read them)
_THINKING_SWITCHES = ("enable_thinking", "thinking")


def reasoning_parser(name: str) -> ReasoningParser | HarmonyParser:
    """The parser of that name; ValueError naming the choices for another."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; the parsers are {sorted(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]


def expects_reasoning(chat_template_kwargs: Mapping[str, Any] | None) -> bool:
    """False when the request turns thinking off (`enable_thinking: false`): its reply is all content."""
    kwargs = chat_template_kwargs or {}
    return not any(kwargs.get(switch) is False for switch in _THINKING_SWITCHES)


def template_reasoning_parser(template: str | None) -> HarmonyParser | None:
    """The parser a chat template implies without `--reasoning-parser`: harmony's for one that writes channels."""
    return REASONING_PARSERS["openai_gptoss"] if template is not None and "<|channel|>" in template else None
