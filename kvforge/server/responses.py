"""POST /v1/responses (OpenAI's Responses API), and GET, DELETE and cancel of stored responses.

A Responses request runs as a chat completion: its instructions and input items (those of the
`previous_response_id` chain first) become chat messages, its tools, tool_choice and text.format the chat
request's tools, tool_choice and response_format, and the chat path renders, constrains and queues it
(chat.start_chat). The chat deltas of its one choice become output items and stream events
(responses_events.ResponseBuilder), streamed or not.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from pydantic import TypeAdapter
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from kvforge.outputs import RequestOutput
from kvforge.server.chat import start_chat
from kvforge.server.chat_reply import ReplyFormat, ReplyStream
from kvforge.server.errors import APIError, as_api_error
from kvforge.server.protocol import ChatCompletionRequest
from kvforge.server.request_fields import check_fields
from kvforge.server.responses_events import ResponseBuilder, new_item_id
from kvforge.server.responses_protocol import (
    DeletedResponse,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    ResponseObject,
    ResponsesRequest,
    TextConfig,
    TextFormat,
)
from kvforge.server.responses_store import ResponseStore, StoredResponse
from kvforge.server.serving import RequestGroup, ServerState, json_response, wait_for_disconnect

router = APIRouter()
_ITEMS = TypeAdapter(list[InputItem])


def _input_items(body: ResponsesRequest) -> list[InputItem]:
    if isinstance(body.input, str):
        return [MessageItem(role="user", content=body.input)]
    return list(body.input)


def _chat_messages(instructions: str | None, items: list[InputItem]) -> list[dict[str, Any]]:
    """Chat messages of the items: a function call joins the assistant message before it (or starts one), its
    output is a `tool` message; developer messages are system messages; reasoning items are left out."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if not (messages and messages[-1]["role"] == "assistant"):
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
    return messages


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    """text.format as chat's response_format; 400 for a json_schema format without its schema."""
    form = text.format if text is not None else None
    if form is None or form.type != "json_schema":
        return None if form is None else {"type": form.type}
    if form.json_schema is None:
        raise APIError(400, "text.format of type json_schema needs its schema", param="text")
    return {"type": "json_schema", "json_schema": {"name": form.name or "response", "schema": form.json_schema,
                                                   "description": form.description, "strict": form.strict}}


def _chat_request(body: ResponsesRequest, items: list[InputItem]) -> ChatCompletionRequest:
    """The chat completion request that produces body's response."""
    tool_choice = body.tool_choice
    if tool_choice is not None and not isinstance(tool_choice, str):
        tool_choice = {"type": "function", "function": {"name": tool_choice.name}}
    tools = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
             for tool in body.tools or []]
    return ChatCompletionRequest(
        model=body.model, messages=_chat_messages(body.instructions, items),
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p, tools=tools or None, tool_choice=tool_choice,
        response_format=_response_format(body.text), parallel_tool_calls=body.parallel_tool_calls)


def _new_response(body: ResponsesRequest, response_id: str, model: str) -> ResponseObject:
    text = body.text or TextConfig(format=TextFormat(type="text"))
    return ResponseObject(id=response_id, status="in_progress", model=model, instructions=body.instructions,
                          max_output_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
                          tools=body.tools or [], tool_choice=body.tool_choice or ("auto" if body.tools else "none"),
                          parallel_tool_calls=body.parallel_tool_calls, text=text,
                          reasoning=body.reasoning, previous_response_id=body.previous_response_id,
                          store=body.store, metadata=body.metadata or {}, user=body.user)


async def _outputs(group: RequestGroup, *stops: asyncio.Future) -> AsyncIterator[RequestOutput]:
    """The group's (one request's) outputs until it finishes, or until one of stops is done first, which
    ends the iteration and aborts the request."""
    outputs = group.outputs()
    step: asyncio.Future | None = None
    try:
        while True:
            step = asyncio.ensure_future(anext(outputs))
            await asyncio.wait({step, *stops}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                return
            try:
                _, output = step.result()
            except StopAsyncIteration:
                return
            yield output
    finally:
        if step is not None and not step.done():
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)
        await outputs.aclose()


async def _run(builder: ResponseBuilder, group: RequestGroup, reply: ReplyFormat, entry: StoredResponse,
               *stops: asyncio.Future) -> AsyncIterator[str]:
    """The response's events, from response.created to its final event; the response ends cancelled when
    one of stops, or entry.stop (a cancel), comes first. The stored entry holds the response as it ends."""
    stop = asyncio.ensure_future(entry.stop.wait())
    texts = ReplyStream(reply)
    final: RequestOutput | None = None
    try:
        for event in builder.start():
            yield event
        async for output in _outputs(group, stop, *stops):
            final = output
            for delta in texts.deltas(output.outputs[0], at_least_one=False):
                for event in builder.add(delta):
                    yield event
        events = builder.finish(final, cancelled=final is None or not final.finished)
        entry.items += _ITEMS.validate_python([item.model_dump() for item in builder.response.output])
        for event in events:
            yield event
    finally:
        stop.cancel()
        _end(entry)


def _end(entry: StoredResponse) -> None:
    """Mark the response ended; one still in progress (an error, or a stream whose client went away) is
    cancelled."""
    if entry.response.status == "in_progress":
        entry.response.status = "cancelled"
    entry.ended.set()


def _stream_response(run: AsyncIterator[str], builder: ResponseBuilder, group: RequestGroup, entry: StoredResponse,
                     headers: dict[str, str]) -> Response:
    """The events as server-sent events; an error mid-stream becomes an `error` event (and ends it). Once the
    response has been sent, or the client has gone, the request is aborted if it still runs."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in run:
                yield event
        except Exception as error:
            api_error = as_api_error(error)
            yield builder.event("error", code=api_error.code, message=api_error.message, param=api_error.param)

    def after() -> None:
        group.abort()
        _end(entry)  # NOTE: a stream whose client left before it began never ran `run`

    return StreamingResponse(body(), media_type="text/event-stream", background=BackgroundTask(after),
                             headers={"Cache-Control": "no-cache", **headers})


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, http_request: Request) -> Response:
    state: ServerState = http_request.app.state.server
    store: ResponseStore = http_request.app.state.responses
    model = state.check_model(body.model)
    headers = check_fields(body)
    if body.include:
        raise APIError(400, f"include: kvforge adds none of {body.include} to its responses", param="include")
    earlier = store.get(body.previous_response_id, "previous_response_id").items if body.previous_response_id else []
    items = _input_items(body)
    response_id = new_item_id("resp")
    run = await start_chat(state, _chat_request(body, [*earlier, *items]), response_id)
    builder = ResponseBuilder(_new_response(body, response_id, model))
    entry = StoredResponse(builder.response, [*earlier, *items])
    if body.store:
        store.put(entry)
    if body.stream:
        events = _run(builder, run.group, run.reply, entry)
        return _stream_response(events, builder, run.group, entry, headers)
    disconnected = asyncio.ensure_future(wait_for_disconnect(http_request))
    try:
        async for _ in _run(builder, run.group, run.reply, entry, disconnected):
            pass
    finally:
        disconnected.cancel()
    if disconnected.done() and not disconnected.cancelled():
        raise APIError(499, "the client closed the request")
    return json_response(builder.response, headers)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, http_request: Request) -> Response:
    store: ResponseStore = http_request.app.state.responses
    return json_response(store.get(response_id).response, {})


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, http_request: Request) -> Response:
    """Stop a response that is running (its output so far is kept, its status is "cancelled"); a response
    that has ended is returned as it is."""
    entry = http_request.app.state.responses.get(response_id)
    entry.stop.set()
    await entry.ended.wait()
    return json_response(entry.response, {})


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, http_request: Request) -> Response:
    entry = http_request.app.state.responses.delete(response_id)
    entry.stop.set()
    return json_response(DeletedResponse(id=response_id), {})
