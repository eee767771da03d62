"""The reasoning parsers on replies cut at every character: what a stream sends of the reasoning and of the
content adds up to the whole reply's split, and no tag, nor a piece of one, is ever sent."""

from __future__ import annotations

import pytest

from kvforge.reasoning.registry import expects_reasoning, reasoning_parser

# (parser, reply, reasoning, content)
CASES = [
    ("qwen3", "<think>\nThe user greets.\n</think>\n\nHello!", "\nThe user greets.\n", "Hello!"),
    ("qwen3", "Hello <think> is a tag, </think> too", None, "Hello <think> is a tag, </think> too"),
    ("qwen3", "<think>never ends <", "never ends <", ""),
    ("qwen3", "<think></think>{\"a\": 1}", "", "{\"a\": 1}"),
    ("qwen3", "<thinking>", None, "<thinking>"),
    ("deepseek_r1", "Count the r's: 3.</think>\nThere are 3.", "Count the r's: 3.", "There are 3."),
    ("deepseek_r1", "<think>a < b</think>b", "a < b", "b"),
    ("deepseek_r1", "no end, all reasoning </thi", "no end, all reasoning </thi", ""),
    # harmony (GPT-OSS): channels; a message to a function is handed on as a call (server/tool_formats.HARMONY)
    ("openai_gptoss", "<|channel|>analysis<|message|>Greets.<|end|><|start|>assistant<|channel|>final<|message|>Hi!",
     "Greets.", "Hi!"),
    ("openai_gptoss", "<|channel|>analysis<|message|>Weather.<|end|><|start|>assistant to=functions.get_weather"
     "<|channel|>commentary json<|message|>{\"city\": \"Paris\"}", "Weather.",
     "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}"),
    ("openai_gptoss", "<|channel|>final<|message|>a < b", None, "a < b"),
    ("openai_gptoss", "<|channel|>analysis<|message|>never ends <|", "never ends <|", ""),
    ("openai_gptoss", "no channels <b>", None, "no channels <b>"),
]


@pytest.mark.parametrize(("name", "reply", "reasoning", "content"), CASES)
def test_split_and_its_stream_at_every_cut(name: str, reply: str, reasoning: str | None, content: str) -> None:
    parser = reasoning_parser(name)
    whole = parser.split(reply, finished=True)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for cut in range(len(reply) + 1):  # a reply streamed in two chunks, cut here
        sent_reasoning, sent_content = "", ""
        for text, finished in ((reply[:cut], False), (reply, True)):
            part = parser.split(text, finished)
            for sent, now in ((sent_reasoning, part.reasoning or ""), (sent_content, part.content)):
                assert now.startswith(sent), f"cut at {cut}: {now!r} takes back what was sent, {sent!r}"
            if part.content:
                assert part.reasoning is None or part.reasoning == (reasoning or ""), "content before reasoning ends"
            sent_reasoning, sent_content = part.reasoning or "", part.content
        assert (sent_reasoning, sent_content) == (reasoning or "", content)
    for cut in range(len(reply)):  # a prefix never shows a tag or the start of one at its end
        part = parser.split(reply[:cut], finished=False)
        for shown in (part.reasoning or "", part.content):
            if reasoning is not None:
                assert "<think>" not in shown and "</think>" not in shown
                assert not shown.endswith(("<", "</", "</th")) or shown in (reasoning, content)


def test_thinking_turned_off_expects_no_reasoning() -> None:
    assert expects_reasoning(None) and expects_reasoning({"enable_thinking": True})
    assert not expects_reasoning({"enable_thinking": False}) and not expects_reasoning({"thinking": False})


def test_an_unknown_parser_is_a_value_error_naming_it() -> None:
    with pytest.raises(ValueError, match="'qwen4'"):
        reasoning_parser("qwen4")
