"""Tool calls through the official `openai` client against the served default model (whose chat template
has no tools, so the generic tool prompt is used): arguments validate against the function's schema
with `jsonschema`, streamed deltas add up to the non-streamed call, and a tool result goes back in. One call per
reply (`parallel_tool_calls: false`): tests/server/test_reasoning.py has several, on a model scripted to write them."""

from __future__ import annotations

import json

import jsonschema
import openai

from tests.server.harness import MODEL_NAME

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
                                            "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _call(client: openai.OpenAI, tool_choice: object, messages: list = ASK) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS, tool_choice=tool_choice,
                                          parallel_tool_calls=False, max_tokens=48, temperature=0)


def _streamed_call(client: openai.OpenAI, tool_choice: object) -> tuple[str, str, str, str]:
    """(id, name, concatenated arguments, finish reason) of a streamed call."""
    call_id = name = finish_reason = None
    arguments = ""
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS,
                                                tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=48,
                                                temperature=0, stream=True):
        choice = chunk.choices[0]
        assert choice.delta.content in (None, "")
        for delta in choice.delta.tool_calls or []:
            assert delta.index == 0
            if delta.id is not None:
                assert call_id is None, "the call's id was sent twice"
                call_id, name = delta.id, delta.function.name
            arguments += delta.function.arguments or ""
        finish_reason = choice.finish_reason or finish_reason
    return call_id, name, arguments, finish_reason


def test_required_and_named_calls_validate(default_client: openai.OpenAI) -> None:
    for tool_choice, names in (("required", set(SCHEMAS)),
                               ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})):
        choice = _call(default_client, tool_choice).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function" and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_streamed_call_equals_the_non_streamed_one(default_client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    (full,) = _call(default_client, named).choices[0].message.tool_calls
    call_id, name, arguments, finish_reason = _streamed_call(default_client, named)
    assert call_id.startswith("call_") and finish_reason == "tool_calls"
    assert (name, arguments) == (full.function.name, full.function.arguments)
    jsonschema.validate(json.loads(arguments), WEATHER)


def test_a_tool_result_goes_back_to_the_model(default_client: openai.OpenAI) -> None:
    first = _call(default_client, "required").choices[0].message
    call = first.tool_calls[0]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    answer = _call(default_client, "none", messages).choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason in ("stop", "length")
