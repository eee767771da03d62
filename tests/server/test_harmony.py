"""GPT-OSS's harmony replies through the official `openai` client, on a tiny model scripted to reply with an analysis
message, `<|channel|>analysis<|message|>The quick fox<|end|>` (tests/scripted_model.py), and a chat template that
writes channels (so the server reads replies as harmony without being told): the analysis is the reasoning and never
reaches the content; a required tool call, and a response_format, are written as the message after it (the grammar
lets the analysis come first), read as a call (or as the JSON content), streamed the same."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from kvforge.reasoning.harmony import SPECIAL_TOKENS
from tests.scripted_model import save_scripted_model
from tests.server.harness import MODEL_NAME, ServerThread, start_tiny_server

REASONING = "The quick fox"
TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}"
            "{% if m.role == 'assistant' and m.tool_calls %}{% for c in m.tool_calls %}"
            "<|channel|>commentary to=functions.{{ c.function.name }} <|constrain|>json<|message|>"
            "{{ c.function.arguments }}<|call|>{% endfor %}"
            "{% elif m.role == 'assistant' %}<|channel|>final<|message|>{{ m.content }}<|end|>"
            "{% else %}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
            "{% if tools %}<|start|>developer<|message|>{{ tools | tojson }}<|end|>{% endif %}"
            "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
ASK = [{"role": "user", "content": "The weather in Paris?"}]
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Berlin"]}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": CITY}} for name in ("get_weather", "get_time")]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    folder: Path = tmp_path_factory.mktemp("harmony")
    save_scripted_model(folder, f"<|channel|>analysis<|message|>{REASONING}<|end|>", special_tokens=SPECIAL_TOKENS,
                        chat_template=TEMPLATE, generation_prompt="<|start|>assistant")
    server: ServerThread = start_tiny_server(folder, dtype="float32")
    yield server.openai_client()
    server.stop()


def _create(client: openai.OpenAI, **fields: object):
    return client.chat.completions.create(model=MODEL_NAME, messages=ASK, temperature=0, max_tokens=160, **fields)


def test_the_analysis_is_the_reasoning(client: openai.OpenAI) -> None:
    message = _create(client).choices[0].message
    assert (message.reasoning_content, message.content) == (REASONING, None)


def test_a_required_call_and_a_response_format_come_after_the_analysis(client: openai.OpenAI) -> None:
    choice = _create(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False).choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == REASONING
    assert call.function.name in {"get_weather", "get_time"} and choice.message.content is None
    jsonschema.validate(json.loads(call.function.arguments), CITY)
    schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    message = _create(client, response_format=schema).choices[0].message
    assert message.reasoning_content == REASONING
    jsonschema.validate(json.loads(message.content), CITY)


def test_the_streamed_call_is_the_non_streamed_one(client: openai.OpenAI) -> None:
    fields = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    (call,) = _create(client, **fields).choices[0].message.tool_calls
    reasoning, names, arguments = "", [], ""
    for chunk in _create(client, stream=True, **fields):
        delta = chunk.choices[0].delta
        assert not delta.content
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for part in delta.tool_calls or []:
            names += [part.function.name] if part.id is not None else []
            arguments += part.function.arguments or ""
    assert (reasoning, names, arguments) == (REASONING, [call.function.name], call.function.arguments)
