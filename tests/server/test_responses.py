"""POST /v1/responses through the official `openai` client and the `openai-agents` SDK, against the served
default model: the client parses every response and stream event into its own types; streamed text is the
concatenation of its deltas; function-call arguments and structured output validate with `jsonschema`; a
stored response continues a conversation, is retrieved, cancelled and deleted."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from agents import Agent, ModelSettings, RunConfig, Runner, function_tool
from agents.models.openai_provider import OpenAIProvider

from kvforge.server.app import ServerConfig
from kvforge.server.responses_store import ResponseStore
from tests.server.harness import API_KEY, MODEL_NAME, ServerThread

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": WEATHER, "strict": True}]
ASK = "What is the weather in Paris?"


def _create(client: openai.OpenAI, **fields: object) -> openai.types.responses.Response:
    fields = {"model": MODEL_NAME, "max_output_tokens": 24, "temperature": 0, **fields}
    return client.responses.create(**fields)


def test_create_retrieve_delete(default_client: openai.OpenAI) -> None:
    response = _create(default_client, input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi!"}]}],
                       instructions="You are terse.", metadata={"run": "1"})
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete") and response.output_text
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert response.usage.output_tokens <= 24 and response.usage.input_tokens > 0
    assert response.metadata == {"run": "1"} and response.instructions == "You are terse."
    assert default_client.responses.retrieve(response.id) == response
    default_client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError) as missing:
        default_client.responses.retrieve(response.id)
    assert missing.value.body["type"] == "not_found_error" and response.id in missing.value.body["message"]


def test_unknown_fields_and_unserved_inputs_are_400(default_client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: bogus"):
        _create(default_client, input="Hi", extra_body={"bogus": 1})
    with pytest.raises(openai.BadRequestError, match="content parts of type 'input_image' are not supported"):
        _create(default_client, input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])


def test_the_openapi_document_lists_the_routes(default_server: ServerThread) -> None:
    paths = default_server.http.get("/openapi.json", headers={"Authorization": f"Bearer {API_KEY}"}).json()["paths"]
    create = paths["/v1/responses"]["post"]["responses"]
    assert {"200", "400", "404"} <= set(create) and "text/event-stream" in create["200"]["content"]
    for method, path in (("get", "/v1/responses/{response_id}"), ("delete", "/v1/responses/{response_id}"),
                         ("post", "/v1/responses/{response_id}/cancel")):
        assert "404" in paths[path][method]["responses"]


def test_stream_events_add_up_to_the_response(default_client: openai.OpenAI) -> None:
    with default_client.responses.stream(model=MODEL_NAME, input="Say hello.", max_output_tokens=64,
                                         temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-4].text == final.output_text and final.status == "completed"
    assert default_client.responses.retrieve(final.id).output_text == deltas


def test_tool_call_round_trip(default_client: openai.OpenAI) -> None:
    first = _create(default_client, input=ASK, tools=TOOLS, tool_choice="required", max_output_tokens=48)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear", "celsius": 21}'}
    second = _create(default_client, input=[result], previous_response_id=first.id, tools=TOOLS, tool_choice="none",
                     max_output_tokens=8)
    assert second.output[0].type == "message" and second.output_text
    # the same as sending the whole conversation: the question, the call and its result
    whole = _create(default_client, input=[{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
                                           result], tools=TOOLS, tool_choice="none", store=False, max_output_tokens=8)
    assert whole.usage.input_tokens == second.usage.input_tokens and whole.output_text == second.output_text


def test_streamed_tool_call(default_client: openai.OpenAI) -> None:
    with default_client.responses.stream(model=MODEL_NAME, input=ASK, tools=TOOLS, max_output_tokens=48,
                                         tool_choice={"type": "function", "name": "get_weather"}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    (call,) = final.output
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments == call.arguments and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_previous_response_id_continues_the_conversation(default_client: openai.OpenAI) -> None:
    first = _create(default_client, input="My name is Ada.", max_output_tokens=8)
    second = _create(default_client, input="What is my name?", previous_response_id=first.id, max_output_tokens=8)
    assert second.previous_response_id == first.id and second.output_text
    whole = _create(default_client, input=[{"role": "user", "content": "My name is Ada."},
                                           {"role": "assistant", "content": first.output_text},
                                           {"role": "user", "content": "What is my name?"}], store=False,
                    max_output_tokens=8)
    assert whole.usage.input_tokens == second.usage.input_tokens > first.usage.total_tokens
    assert whole.output_text == second.output_text
    unstored = _create(default_client, input="Hi", store=False, max_output_tokens=1)
    for ask in (lambda: default_client.responses.retrieve(unstored.id),
                lambda: _create(default_client, input="Hi", previous_response_id=unstored.id)):
        with pytest.raises(openai.NotFoundError):
            ask()


def test_the_store_keeps_the_newest_responses(default_server: ServerThread, default_client: openai.OpenAI) -> None:
    kept = default_server.app.state.responses
    default_server.app.state.responses = ResponseStore(2)  # as `--max-stored-responses 2` sets it
    try:
        ids = [_create(default_client, input=f"Count to {n}.", max_output_tokens=1).id for n in range(3)]
        with pytest.raises(openai.NotFoundError):
            default_client.responses.retrieve(ids[0])
        assert [default_client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
    finally:
        default_server.app.state.responses = kept
    with pytest.raises(ValueError, match="max_stored_responses must be >= 0, got -1"):
        ServerConfig((MODEL_NAME,), max_stored_responses=-1)


def test_text_format_json_schema(default_client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    response = _create(default_client, input="Name a big city and its population, as JSON.", max_output_tokens=64,
                       text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}})
    assert response.status == "completed" and response.text.format.type == "json_schema"
    jsonschema.validate(json.loads(response.output_text), schema)


def test_cancel_stops_a_running_response(default_client: openai.OpenAI) -> None:
    with default_client.responses.create(model=MODEL_NAME, input="Tell me a long story.", max_output_tokens=512,
                                         stream=True) as stream:
        events = []
        for event in stream:
            events.append(event)
            if event.type == "response.output_text.delta":
                cancelled = default_client.responses.cancel(events[0].response.id)
                assert cancelled.status == "cancelled"
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "cancelled"
    assert events[-1].response.usage.output_tokens < 512
    assert default_client.responses.retrieve(cancelled.id).status == "cancelled"


def test_agents_sdk_runs_a_function_tool(default_server: ServerThread) -> None:
    calls = []

    # NOTE: the tiny model, once shown a tool, calls it again and again; so the first turn must call it and the
    # tool leaves the agent once it has run, and the next turn answers with the tool's result (one call a turn:
    # parallel_tool_calls false)
    @function_tool(is_enabled=lambda _context, _agent: not calls)
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    agent = Agent(name="weather", instructions="Answer in one short sentence.", tools=[get_weather], model=MODEL_NAME,
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=128,
                                               temperature=0))
    client = openai.AsyncOpenAI(base_url=f"{default_server.base_url}/v1", api_key=API_KEY, max_retries=0)
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
    result = Runner.run_sync(agent, ASK, run_config=config, max_turns=3)
    asyncio.run(client.close())
    assert len(calls) == 1 and calls[0]
    assert isinstance(result.final_output, str) and result.final_output
