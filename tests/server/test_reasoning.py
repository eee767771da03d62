"""Reasoning parsers and parallel tool calls through the official `openai` client, on a tiny model scripted to
reply `<think>The quick fox</think>Paris` (tests/scripted_model.py) and served with `reasoning_parser="qwen3"`.

The script makes the reply known in advance, so these tests see the server's path end to end: the split of
the reasoning from the content (streamed and not), a response_format or tool grammar armed only once the
reasoning ended (the scripted reasoning could not be written under a JSON grammar, the scripted content
"Paris" is not JSON), and several tool calls in one reply, streamed with their indices."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.scripted_model import save_scripted_model
from tests.server.harness import MODEL_NAME, ServerThread, start_tiny_server

REASONING, CONTENT = "The quick fox", "Paris"
ASK = [{"role": "user", "content": "The weather in Paris, and the time?"}]
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Berlin"]}}, "required": ["city"],
        "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"enum": ["CET", "UTC"]}}, "required": ["timezone"],
        "additionalProperties": False}
SCHEMAS = {"get_weather": CITY, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema}} for name, schema in SCHEMAS.items()]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    folder: Path = tmp_path_factory.mktemp("scripted")
    save_scripted_model(folder, f"<think>{REASONING}</think>{CONTENT}")
    server: ServerThread = start_tiny_server(folder, reasoning_parser="qwen3", dtype="float32")
    yield server.openai_client()
    server.stop()


def _create(client: openai.OpenAI, **fields: object):
    return client.chat.completions.create(model=MODEL_NAME, messages=ASK, temperature=0, **fields)


def _reasoning(delta) -> str:
    """A streamed delta's reasoning: a field the client's models do not declare (absent: none)."""
    reasoning = getattr(delta, "reasoning_content", None) or ""
    assert reasoning == (getattr(delta, "reasoning", None) or "")
    return reasoning


def _streamed(client: openai.OpenAI, **fields: object) -> list:
    """The stream's deltas, each checked to carry something: no empty delta but the first (the role's) and the
    one with the finish reason."""
    deltas = []
    for chunk in _create(client, stream=True, **fields):
        (choice,) = chunk.choices
        delta = choice.delta
        assert delta.role == ("assistant" if not deltas else None)
        assert delta.role or delta.content or delta.tool_calls or _reasoning(delta) or choice.finish_reason
        deltas.append(delta)
    return deltas


def test_the_reasoning_comes_apart_from_the_content(client: openai.OpenAI) -> None:
    message = _create(client, max_tokens=16).choices[0].message
    assert (message.reasoning_content, message.reasoning, message.content) == (REASONING, REASONING, CONTENT)
    deltas = _streamed(client, max_tokens=16)
    kinds = ["reasoning" if _reasoning(d) else "content" for d in deltas if _reasoning(d) or d.content]
    assert kinds == sorted(kinds, reverse=True), "a reasoning delta came after content"  # reasoning first
    assert "".join(_reasoning(d) for d in deltas) == REASONING
    assert "".join(d.content or "" for d in deltas) == CONTENT  # no tag in either


def test_a_response_format_applies_after_the_reasoning(client: openai.OpenAI) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    message = _create(client, max_tokens=32, response_format=response_format).choices[0].message
    assert message.reasoning_content == REASONING
    jsonschema.validate(json.loads(message.content), CITY)
    # thinking turned off: no reasoning expected, the grammar holds from the first token
    message = _create(client, max_tokens=32, response_format=response_format,
                      extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert message.reasoning_content is None
    jsonschema.validate(json.loads(message.content), CITY)


def test_parallel_tool_calls_after_the_reasoning(client: openai.OpenAI) -> None:
    single = _create(client, max_tokens=200, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    (call,) = single.choices[0].message.tool_calls
    assert single.choices[0].finish_reason == "tool_calls" and single.choices[0].message.reasoning == REASONING
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    # min_tokens keeps EOS out past the first call: the model goes on with a second one, which only
    # parallel_tool_calls admits (without, the grammar ends the reply after the first call)
    fields = dict(max_tokens=200, tools=TOOLS, tool_choice="required",
                  extra_body={"min_tokens": single.usage.completion_tokens + 2})
    assert len(_create(client, parallel_tool_calls=False, **fields).choices[0].message.tool_calls) == 1
    fields["parallel_tool_calls"] = True
    choice = _create(client, **fields).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert len(calls) == 2 and len({c.id for c in calls}) == 2
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    deltas = _streamed(client, **fields)
    streamed = {}
    for delta in deltas:
        for call_delta in delta.tool_calls or []:
            if call_delta.index not in streamed:  # a call's first delta: id, type and name
                assert call_delta.id.startswith("call_") and call_delta.type == "function"
                streamed[call_delta.index] = [call_delta.function.name, ""]
            else:
                assert call_delta.id is None and call_delta.function.name is None and call_delta.function.arguments
            streamed[call_delta.index][1] += call_delta.function.arguments or ""
    assert sorted(streamed) == [0, 1]
    assert [streamed[i] for i in (0, 1)] == [[c.function.name, c.function.arguments] for c in calls]
    assert "".join(_reasoning(d) for d in deltas) == REASONING


def test_responses_put_the_reasoning_in_a_reasoning_item_before_the_message(client: openai.OpenAI) -> None:
    """/v1/responses: the reasoning is an output item of its own (reasoning_text), streamed as its own events, and
    a stored reply with its reasoning continues a conversation (previous_response_id)."""
    response = client.responses.create(model=MODEL_NAME, input=ASK[0]["content"], temperature=0)
    reasoning, message = response.output
    assert (reasoning.type, message.type) == ("reasoning", "message")
    assert [part.text for part in reasoning.content] == [REASONING] and response.output_text == CONTENT
    events = list(client.responses.create(model=MODEL_NAME, input=ASK[0]["content"], temperature=0, stream=True))
    kinds = [event.type for event in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == REASONING
    (done,) = [e for e in events if e.type == "response.completed"]
    assert [item.type for item in done.response.output] == ["reasoning", "message"]
    follow_up = client.responses.create(model=MODEL_NAME, input="And Berlin?", temperature=0,
                                        previous_response_id=response.id)
    assert follow_up.output_text == CONTENT
