"""POST /v1/chat/completions: messages through the model's chat template, streamed or not, with logprobs."""

from __future__ import annotations

from collections.abc import AsyncIterator

import jinja2
from fastapi import APIRouter, Request
from starlette.responses import Response

from kvforge.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from kvforge.server.errors import APIError
from kvforge.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    TopLogprob,
)
from kvforge.server.serving import (
    ChoiceProgress,
    RequestGroup,
    ServerState,
    max_tokens_in_context,
    new_request_id,
    off_loop_if_large,
    sampling_params,
    sse,
    sse_response,
    usage,
)
from kvforge.server.tools import ToolPlan, may_become_call, new_call_id, parse_call, plan_tools
from kvforge.structured_output.params import StructuredOutputParams
from kvforge.tokenizer import Tokenizer

router = APIRouter()


def _message_dict(message: ChatMessage) -> dict:
    fields = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):
        fields["content"] = "\n".join(part.text for part in message.content)
    return fields


async def _prompt_token_ids(tokenizer: Tokenizer, body: ChatCompletionRequest, plan: ToolPlan) -> list[int]:
    messages = plan.messages
    num_chars = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
    try:
        return await off_loop_if_large(num_chars, tokenizer.apply_chat_template, messages,
                                       add_generation_prompt=body.add_generation_prompt, tokenize=True,
                                       **plan.template_kwargs)
    except (ValueError, TypeError, jinja2.TemplateError) as error:  # the template rejects the messages
        raise APIError(400, f"cannot apply the chat template: {error}", param="messages") from error


def _check_fields(body: ChatCompletionRequest) -> None:
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")


def _response_format(body: ChatCompletionRequest) -> StructuredOutputParams | None:
    """The constraint response_format asks for (`strict` or not, the schema is enforced)."""
    response_format = body.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputParams(json_object=True)
    if response_format.json_schema is None:
        raise APIError(400, "response_format json_schema needs its json_schema field", param="response_format")
    return StructuredOutputParams(json=response_format.json_schema.json_schema)


def _constraint(body: ChatCompletionRequest, plan: ToolPlan) -> dict[str, StructuredOutputParams]:
    constraint = plan.structured_output or _response_format(body)
    return {} if constraint is None else {"structured_output": constraint}


def _num_logprobs(body: ChatCompletionRequest) -> int | None:
    return (body.top_logprobs or 0) if body.logprobs else None


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, http_request: Request) -> Response:
    state: ServerState = http_request.app.state.server
    model = state.check_model(body.model)
    _check_fields(body)
    num_logprobs = _num_logprobs(body)
    tokenizer = state.engine.tokenizer
    plan = plan_tools(body, [_message_dict(m) for m in body.messages], tokenizer.chat_template)
    token_ids = await _prompt_token_ids(tokenizer, body, plan)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = sampling_params(state, body, max_tokens_in_context(state, len(token_ids), requested),
                             logprobs=num_logprobs, **_constraint(body, plan))
    request_id = new_request_id("chatcmpl")
    group = RequestGroup(state)
    await group.start(request_id, [(token_ids, params)])
    if body.stream:
        return sse_response(group, _stream(group, body, plan, request_id, model))
    (output,) = await group.final_outputs(http_request)
    choices = [ChatChoice(index=c.index, message=_message(c, plan), finish_reason=_finish_reason(c, plan),
                          logprobs=_logprobs(c, 0, num_logprobs))
               for c in output.outputs]
    return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage([output]))


def _message(completion: CompletionOutput, plan: ToolPlan) -> AssistantMessage:
    call = parse_call(completion.text, finished=True) if plan.reads_calls else None
    if call is None:
        return AssistantMessage(content=completion.text)
    name, arguments = call
    return AssistantMessage(tool_calls=[ToolCall(id=new_call_id(), function=FunctionCall(name=name,
                                                                                        arguments=arguments))])


def _finish_reason(completion: CompletionOutput, plan: ToolPlan) -> str | None:
    is_call = plan.reads_calls and parse_call(completion.text, finished=True) is not None
    return "tool_calls" if is_call and completion.finish_reason == "stop" else completion.finish_reason


class _ToolCallStream:
    """What one streamed choice has sent of its text, or of its tool call's arguments."""

    def __init__(self, reads_calls: bool) -> None:
        self.reads_calls = reads_calls
        self.num_chars = 0  # of the text, or of the arguments once the reply is a call
        self.call_id: str | None = None

    def delta(self, completion: CompletionOutput, first: bool) -> DeltaMessage:
        role = "assistant" if first else None
        text, finished = completion.text, completion.finished
        call = parse_call(text, finished) if self.reads_calls else None
        if call is None:
            if self.reads_calls and not finished and may_become_call(text):
                return DeltaMessage(role=role)  # held back until it is text or a call
            sent, self.num_chars = self.num_chars, len(text)
            return DeltaMessage(role=role, content=text[sent:])
        name, arguments = call
        sent, self.num_chars = self.num_chars, len(arguments)
        if self.call_id is None:
            self.call_id = new_call_id()
            tool_call = DeltaToolCall(index=0, id=self.call_id, type="function",
                                      function=DeltaFunctionCall(name=name, arguments=arguments))
        else:
            tool_call = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=arguments[sent:]))
        return DeltaMessage(role=role, tool_calls=[tool_call])


async def _stream(group: RequestGroup, body: ChatCompletionRequest, plan: ToolPlan, request_id: str,
                  model: str) -> AsyncIterator[str]:
    num_logprobs = _num_logprobs(body)

    def chunk(choice: ChatChunkChoice) -> str:
        return sse(ChatCompletionChunk(id=request_id, model=model, choices=[choice]), exclude_none=True)

    sent = [ChoiceProgress() for _ in range(body.n)]
    texts = [_ToolCallStream(plan.reads_calls) for _ in range(body.n)]
    final: RequestOutput | None = None
    async for _, output in group.outputs():
        final = output
        for c in output.outputs:
            if not sent[c.index].has_news(c):
                continue
            _, num_tokens, first = sent[c.index].advance(c)
            delta = texts[c.index].delta(c, first)
            yield chunk(ChatChunkChoice(index=c.index, delta=delta, finish_reason=_finish_reason(c, plan),
                                        logprobs=_logprobs(c, num_tokens, num_logprobs)))
    if body.include_usage_in_stream and final is not None:
        yield sse(ChatCompletionChunk(id=request_id, model=model, choices=[], usage=usage([final])),
                  exclude_none=True)


def _logprobs(completion: CompletionOutput, num_tokens: int, num_top: int | None) -> ChatLogprobs | None:
    """The chat-style logprobs of the completion's tokens from num_tokens on."""
    if num_top is None:
        return None
    # NOTE: the engine appends to this list as it runs; read only the tokens this output has.
    positions = (completion.logprobs or [])[num_tokens : len(completion.token_ids)]
    return ChatLogprobs(content=[_token_logprob(token_id, position, num_top)
                                 for token_id, position in zip(completion.token_ids[num_tokens:], positions,
                                                               strict=True)])


def _token_logprob(token_id: int, position: PositionLogprobs, num_top: int) -> ChatTokenLogprob:
    entry = position[token_id]
    ranked = sorted((lp for lp in position.values() if lp.rank is not None and lp.rank <= num_top),
                    key=lambda lp: lp.rank)
    top = [TopLogprob(token=lp.decoded_token or "", logprob=lp.logprob, bytes=_bytes(lp.decoded_token))
           for lp in ranked]
    token = entry.decoded_token or ""
    return ChatTokenLogprob(token=token, logprob=entry.logprob, bytes=_bytes(token), top_logprobs=top)


def _bytes(text: str | None) -> list[int]:
    return list((text or "").encode("utf-8"))
