"""A chat reply as the client reads it: the reasoning apart from the content, tool calls parsed from the content.

Non-streamed, `ReplyFormat.message` and `finish_reason` read a finished completion. Streamed, a
`ReplyStream` per choice turns each new output into deltas: the reasoning's first, then the content's or
the tool calls'; never an empty one (text that may still become a tag or a call waits for the next
output). Each tool call has its index (0, 1, ...); its first delta carries its id, type and name, the next
ones fragments of its arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvforge.outputs import CompletionOutput
from kvforge.reasoning.harmony import HarmonyParser
from kvforge.reasoning.parser import ReasoningParser, ReasoningSplit
from kvforge.server.protocol import (
    AssistantMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from kvforge.server.tool_formats import CallFormat


@dataclass(frozen=True, slots=True)
class ReplyFormat:
    """How one request's replies are read: its reasoning parser (None: no reasoning expected, the reply is
    all content) and the format of the tool calls the content is read for (None: not read)."""

    reasoning: ReasoningParser | HarmonyParser | None
    calls: CallFormat | None

    @property
    def special_tokens(self) -> bool:
        """Whether replies are read for special tokens (their text must keep them)."""
        return any(part is not None and part.special_tokens for part in (self.reasoning, self.calls))

    def split(self, text: str, finished: bool) -> ReasoningSplit:
        return ReasoningSplit(None, text) if self.reasoning is None else self.reasoning.split(text, finished)

    def message(self, completion: CompletionOutput, echo: str) -> AssistantMessage:
        """The message of a finished completion; echo goes in front of its content."""
        split = self.split(completion.text, finished=True)
        reasoning = {"reasoning_content": split.reasoning, "reasoning": split.reasoning}
        calls = None if self.calls is None else self.calls.parse(split.content)
        if calls is None:
            content = echo + split.content
            return AssistantMessage(content=content if content or split.reasoning is None else None, **reasoning)
        return AssistantMessage(tool_calls=[ToolCall(id=self.calls.new_call_id(),
                                                     function=FunctionCall(name=name, arguments=args))
                                            for name, args in calls], **reasoning)

    def finish_reason(self, completion: CompletionOutput) -> str | None:
        """The completion's finish reason; "tool_calls" when it stopped after writing calls."""
        if completion.finish_reason != "stop" or self.calls is None:
            return completion.finish_reason
        is_call = self.calls.parse(self.split(completion.text, finished=True).content) is not None
        return "tool_calls" if is_call else "stop"


@dataclass(slots=True)
class ReplyStream:
    """What one streamed choice has sent: the role, the reasoning's and the content's characters, and each
    tool call's id and arguments' characters."""

    reply: ReplyFormat
    role_sent: bool = False
    num_reasoning_chars: int = 0
    num_content_chars: int = 0
    call_ids: list[str] = field(default_factory=list)
    num_argument_chars: list[int] = field(default_factory=list)

    def deltas(self, completion: CompletionOutput, at_least_one: bool) -> list[DeltaMessage]:
        """The deltas of what completion adds to what was sent (at_least_one: an empty delta if nothing)."""
        split = self.reply.split(completion.text, completion.finished)
        deltas = []
        reasoning = (split.reasoning or "")[self.num_reasoning_chars:]
        if reasoning:
            self.num_reasoning_chars += len(reasoning)
            deltas.append(DeltaMessage(reasoning_content=reasoning, reasoning=reasoning))
        content = self._content_delta(split.content, completion.finished)
        deltas += [content] if content is not None else []
        if not deltas and at_least_one:
            deltas.append(DeltaMessage())
        if deltas and not self.role_sent:
            deltas[0].role, self.role_sent = "assistant", True
        return deltas

    def _content_delta(self, content: str, finished: bool) -> DeltaMessage | None:
        call_format = self.reply.calls
        calls = None if call_format is None else call_format.parse(content)
        if calls is None:
            if call_format is not None and not finished and call_format.may_become_call(content):
                return None  # held back until it is text or a call
            new, self.num_content_chars = content[self.num_content_chars:], len(content)
            return DeltaMessage(content=new) if new else None
        tool_calls = [delta for index, (name, arguments) in enumerate(calls)
                      if (delta := self._call_delta(index, name, arguments)) is not None]
        return DeltaMessage(tool_calls=tool_calls) if tool_calls else None

    def _call_delta(self, index: int, name: str, arguments: str) -> DeltaToolCall | None:
        if index == len(self.call_ids):  # a new call: its id, type and name
            self.call_ids.append(self.reply.calls.new_call_id())
            self.num_argument_chars.append(len(arguments))
            return DeltaToolCall(index=index, id=self.call_ids[index], type="function",
                                 function=DeltaFunctionCall(name=name, arguments=arguments))
        sent, self.num_argument_chars[index] = self.num_argument_chars[index], len(arguments)
        if len(arguments) == sent:
            return None
        return DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=arguments[sent:]))
