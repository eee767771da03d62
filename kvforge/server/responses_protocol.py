"""The Responses API's request and response bodies (POST /v1/responses), as pydantic models.

Only what kvforge serves is declared: text in and out, function tools and their calls, structured output.
Input items of other kinds (images, files, built-in tools' calls) fail validation: a 400 naming the field.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    Tag,
    model_serializer,
)

from kvforge.server.protocol import Text


class InputTextPart(BaseModel):
    type: Literal["input_text"]
    text: Text


class OutputTextPart(BaseModel):
    """Text the model wrote, as an earlier response returned it (an assistant message sent back)."""

    type: Literal["output_text"] = "output_text"
    text: Text
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] | None = None


ContentPart = Annotated[InputTextPart | OutputTextPart, Field(discriminator="type")]


class MessageItem(BaseModel):
    """A message: the easy form ({role, content: "text"}) or an item with content parts."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(BaseModel):
    """A function call the model made (an output item, or sent back as input)."""

    type: Literal["function_call"] = "function_call"
    id: str | None = None
    call_id: str
    name: str
    arguments: str  # JSON text
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(BaseModel):
    """What the client's function returned for a call_id."""

    type: Literal["function_call_output"]
    call_id: str | None = None
    output: Text | list[InputTextPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningTextPart(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: Text


class ReasoningItem(BaseModel):
    """The reasoning of a reply (a server with a reasoning parser), before its message or calls; sent back as input,
    it is left out of the prompt, as chat templates leave earlier turns' reasoning out."""

    type: Literal["reasoning"] = "reasoning"
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningTextPart] | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_kind(item: Any) -> str | None:
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)
    return kind


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_item_kind)]


class FunctionTool(BaseModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """`text.format`: plain text, any JSON object, or JSON following a schema (enforced, strict or not)."""

    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_serializer(mode="wrap")
    def _as_sent(self, dump: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The fields that are set, under their API names ("schema")."""
        return {"schema" if name == "json_schema" else name: value for name, value in dump(self).items()
                if value is not None}


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None


_ITEM_KINDS = ("message", "function_call", "function_call_output", "reasoning")
_PART_KINDS = ("input_text", "output_text")


def _served_kinds(items: Any) -> Any:
    """items, unless one is of a kind kvforge does not take: then a ValueError naming it (which the 400 says,
    rather than every union member's complaint)."""
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind not in _ITEM_KINDS:
            raise ValueError(f"input items of type {kind!r} are not supported; kvforge takes {list(_ITEM_KINDS)}")
        content = {"message": item.get("content"), "function_call_output": item.get("output")}.get(kind)
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") not in _PART_KINDS:
                raise ValueError(f"content parts of type {part.get('type')!r} are not supported; kvforge takes "
                                 f"text: {list(_PART_KINDS)}")
    return items


def _default_if_none(default: object) -> BeforeValidator:
    """A field that may be sent as null, which means its default (as OpenAI reads it)."""
    return BeforeValidator(lambda value: default if value is None else value)


class ResponsesRequest(BaseModel):
    """POST /v1/responses. Other fields are kept in `model_extra`, and request_fields.check_fields refuses
    them or reports them ignored."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: Annotated[Text | list[InputItem], BeforeValidator(_served_kinds)] = Field(min_length=1)
    instructions: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: Annotated[float, _default_if_none(1.0)] = 1.0
    top_p: Annotated[float, _default_if_none(1.0)] = 1.0
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: Annotated[bool, _default_if_none(True)] = True
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None  # accepted; reasoning items come from the server's reasoning parser
    store: Annotated[bool, _default_if_none(True)] = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    stream: Annotated[bool, _default_if_none(False)] = False
    include: list[str] | None = None  # what OpenAI may add to outputs; kvforge adds none of it
    truncation: Literal["disabled"] | None = None  # "auto" would drop earlier turns; kvforge never does


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputTextPart]


OutputItem = Annotated[ReasoningItem | OutputMessage | FunctionCallItem, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


def _now() -> int:
    return int(time.time())


class ResponseObject(BaseModel):
    """A response, as created, streamed (in its lifecycle events), retrieved and cancelled."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=_now)
    status: Literal["in_progress", "completed", "incomplete", "cancelled"]
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float
    top_p: float
    tools: list[FunctionTool]
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice
    parallel_tool_calls: bool
    text: TextConfig
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: None = None  # a failure is an error answer (or event), never a stored response


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True
