"""A response's output, built from the chat deltas of its one choice, and the stream events that tell it.

Every response, streamed or not, is built here, so the items a stream announced are the items the final
response holds (the same ids, the same call ids). The events, each with the next `sequence_number`:

    response.created, response.in_progress
    per output item:  response.output_item.added
        reasoning:    response.reasoning_text.delta..., response.reasoning_text.done (when the answer begins)
        a message:    response.content_part.added, response.output_text.delta..., response.output_text.done,
                      response.content_part.done
        a call:       response.function_call_arguments.delta..., response.function_call_arguments.done
                      response.output_item.done
    response.completed (status completed), or response.incomplete (incomplete, or cancelled)
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pydantic import BaseModel

from kvforge.outputs import RequestOutput
from kvforge.server.protocol import DeltaMessage
from kvforge.server.responses_protocol import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputTextPart,
    ReasoningItem,
    ReasoningTextPart,
    ResponseObject,
    ResponseUsage,
)
from kvforge.server.serving import usage


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _json(value: Any) -> Any:
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value


class ResponseBuilder:
    """Grows `response.output` from chat deltas and returns the stream events of each change (as SSE text)."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self.num_events = 0
        self._reasoning: ReasoningItem | None = None  # the reasoning item being written
        self._message: OutputMessage | None = None  # the message item being written
        self._calls: dict[int, FunctionCallItem] = {}  # the call items, by the delta's tool-call index

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.num_events, **{k: _json(v) for k, v in fields.items()}}
        self.num_events += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def start(self) -> list[str]:
        return [self.event("response.created", response=self.response),
                self.event("response.in_progress", response=self.response)]

    def add(self, delta: DeltaMessage) -> list[str]:
        events = []
        if delta.reasoning_content:
            events += self._reasoning_text(delta.reasoning_content)
        if delta.content:
            events += self._text(delta.content)
        for call in delta.tool_calls or []:
            events += self._call(call.index, call.id, call.function.name, call.function.arguments or "")
        return events

    def _position(self, item: ReasoningItem | OutputMessage | FunctionCallItem) -> int:
        return next(i for i, other in enumerate(self.response.output) if other is item)

    def _open(self, item: ReasoningItem | OutputMessage | FunctionCallItem) -> list[str]:
        """Add an item; the reasoning's ends as the answer's first item begins."""
        events = []
        if self._reasoning is not None and self._reasoning.status == "in_progress" and item is not self._reasoning:
            events = self._close(self._reasoning, "completed")
        self.response.output.append(item)
        return [*events,
                self.event("response.output_item.added", output_index=len(self.response.output) - 1, item=item)]

    def _reasoning_text(self, text: str) -> list[str]:
        events = []
        if self._reasoning is None:
            self._reasoning = ReasoningItem(id=new_item_id("rs"), status="in_progress", content=[])
            events += self._open(self._reasoning)
            self._reasoning.content.append(ReasoningTextPart(text=""))
        self._reasoning.content[0].text += text
        events.append(self.event("response.reasoning_text.delta", item_id=self._reasoning.id,
                                 output_index=self._position(self._reasoning), content_index=0, delta=text))
        return events

    def _text(self, text: str) -> list[str]:
        events = []
        if self._message is None:
            self._message = OutputMessage(id=new_item_id("msg"), status="in_progress", content=[])
            events += self._open(self._message)
            events.append(self.event("response.content_part.added", item_id=self._message.id,
                                     output_index=self._position(self._message), content_index=0,
                                     part=OutputTextPart(text="")))
            self._message.content.append(OutputTextPart(text=""))
        self._message.content[0].text += text
        events.append(self.event("response.output_text.delta", item_id=self._message.id,
                                 output_index=self._position(self._message), content_index=0, delta=text,
                                 logprobs=[]))
        return events

    def _call(self, index: int, call_id: str | None, name: str | None, arguments: str) -> list[str]:
        events = []
        item = self._calls.get(index)
        if item is None:
            assert call_id is not None and name is not None, "a call's first delta names it"
            item = self._calls[index] = FunctionCallItem(id=new_item_id("fc"), call_id=call_id, name=name,
                                                         arguments="", status="in_progress")
            events += self._open(item)
        if arguments:
            item.arguments += arguments
            events.append(self.event("response.function_call_arguments.delta", item_id=item.id,
                                     output_index=self._position(item), delta=arguments))
        return events

    def _close(self, item: ReasoningItem | OutputMessage | FunctionCallItem, status: str) -> list[str]:
        """The item's closing events, with its final status."""
        item.status, position = status, self._position(item)
        if isinstance(item, ReasoningItem):
            events = [self.event("response.reasoning_text.done", item_id=item.id, output_index=position,
                                 content_index=0, text=item.content[0].text)]
        elif isinstance(item, OutputMessage):
            part = item.content[0]
            events = [self.event("response.output_text.done", item_id=item.id, output_index=position,
                                 content_index=0, text=part.text, logprobs=[]),
                      self.event("response.content_part.done", item_id=item.id, output_index=position,
                                 content_index=0, part=part)]
        else:
            events = [self.event("response.function_call_arguments.done", item_id=item.id, output_index=position,
                                 arguments=item.arguments)]
        return [*events, self.event("response.output_item.done", output_index=position, item=item)]

    def finish(self, output: RequestOutput | None, cancelled: bool) -> list[str]:
        """Close every item and set the response's status and usage (output: the request's last output)."""
        completion = output.outputs[0] if output is not None else None
        finished = completion is not None and completion.finished and not cancelled
        item_status = "completed" if finished and completion.finish_reason != "length" else "incomplete"
        events = []
        for item in self.response.output:
            if item.status == "in_progress":
                events += self._close(item, item_status)
        if output is not None:
            counts = usage([output])
            self.response.usage = ResponseUsage(
                input_tokens=counts.prompt_tokens, output_tokens=counts.completion_tokens,
                total_tokens=counts.total_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=output.num_cached_tokens))
        if cancelled:
            self.response.status = "cancelled"
        elif item_status == "incomplete":
            self.response.status = "incomplete"
            self.response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        else:
            self.response.status = "completed"
        final = "response.completed" if self.response.status == "completed" else "response.incomplete"
        events.append(self.event(final, response=self.response))
        return events
