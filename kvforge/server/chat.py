"""POST /v1/chat/completions: messages through the model's chat template, streamed or not, with logprobs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Request
from starlette.responses import Response

from kvforge.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from kvforge.server.chat_prompt import chat_prompt_token_ids
from kvforge.server.errors import APIError
from kvforge.server.logprob_views import prompt_logprobs, token_name
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
from kvforge.server.request_fields import check_fields
from kvforge.server.serving import (
    ChoiceProgress,
    RequestGroup,
    ServerState,
    json_response,
    max_tokens_in_context,
    new_request_id,
    sampling_params,
    sse,
    sse_response,
    usage,
)
from kvforge.server.tools import ToolPlan, may_become_call, new_call_id, parse_call, plan_tools
from kvforge.structured_output.params import StructuredOutputParams

router = APIRouter()


def _message_dict(message: ChatMessage) -> dict:
    fields = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):
        fields["content"] = "\n".join(part.text for part in message.content)
    return fields


def _check_values(body: ChatCompletionRequest) -> None:
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


@dataclass(slots=True)
class ChatRun:
    """A chat request queued in the engine: its engine requests, its tool plan and its messages."""

    group: RequestGroup
    plan: ToolPlan
    messages: list[dict]


async def start_chat(state: ServerState, body: ChatCompletionRequest, request_id: str) -> ChatRun:
    """Render body's messages through the chat template (tools included), build its sampling parameters and
    queue it; 400 for a bad value. POST /v1/responses runs its requests through here too."""
    _check_values(body)
    tokenizer = state.engine.tokenizer
    messages = [_message_dict(m) for m in body.messages]
    plan = plan_tools(body, messages, tokenizer.chat_template)
    token_ids = await chat_prompt_token_ids(tokenizer, plan.messages, body.add_generation_prompt,
                                            body.continue_final_message, body.chat_template_kwargs,
                                            plan.template_kwargs)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = sampling_params(state, body, max_tokens_in_context(state, len(token_ids), requested),
                             logprobs=_num_logprobs(body), prompt_logprobs=body.prompt_logprobs,
                             **_constraint(body, plan))
    group = RequestGroup(state)
    await group.start(request_id, [({"prompt_token_ids": token_ids}, params)])
    return ChatRun(group, plan, messages)


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, http_request: Request) -> Response:
    state: ServerState = http_request.app.state.server
    model = state.check_model(body.model)
    headers = check_fields(body)
    num_logprobs = _num_logprobs(body)
    request_id = new_request_id("chatcmpl")
    run = await start_chat(state, body, request_id)
    group, plan = run.group, run.plan
    echo = _echo(body, run.messages)
    if body.stream:
        return sse_response(group, _stream(group, body, plan, echo, request_id, model), headers)
    (output,) = await group.final_outputs(http_request)
    choices = [ChatChoice(index=c.index, message=_message(c, plan, echo), finish_reason=_finish_reason(c, plan),
                          logprobs=_logprobs(c, 0, num_logprobs, body.return_tokens_as_token_ids))
               for c in output.outputs]
    return json_response(ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage([output]),
                                                prompt_logprobs=prompt_logprobs(output.prompt_logprobs)),
                         headers)


def _echo(body: ChatCompletionRequest, messages: list[dict]) -> str:
    """What `echo` puts in front of each reply: the last message's text when it is the assistant's (the
    message the reply continues, with continue_final_message), as vLLM does; otherwise nothing."""
    last = messages[-1]
    if not body.echo or last["role"] != "assistant" or not isinstance(last.get("content"), str):
        return ""
    return last["content"]


def _message(completion: CompletionOutput, plan: ToolPlan, echo: str) -> AssistantMessage:
    call = parse_call(completion.text, finished=True) if plan.reads_calls else None
    if call is None:
        return AssistantMessage(content=echo + completion.text)
    name, arguments = call
    return AssistantMessage(tool_calls=[ToolCall(id=new_call_id(), function=FunctionCall(name=name,
                                                                                        arguments=arguments))])


def _finish_reason(completion: CompletionOutput, plan: ToolPlan) -> str | None:
    is_call = plan.reads_calls and parse_call(completion.text, finished=True) is not None
    return "tool_calls" if is_call and completion.finish_reason == "stop" else completion.finish_reason


class ToolCallStream:
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


async def _stream(group: RequestGroup, body: ChatCompletionRequest, plan: ToolPlan, echo: str, request_id: str,
                  model: str) -> AsyncIterator[str]:
    num_logprobs = _num_logprobs(body)

    def chunk(choice: ChatChunkChoice) -> str:
        return sse(ChatCompletionChunk(id=request_id, model=model, choices=[choice]), exclude_none=True)

    sent = [ChoiceProgress() for _ in range(body.n)]
    texts = [ToolCallStream(plan.reads_calls) for _ in range(body.n)]
    if echo:
        for index, progress in enumerate(sent):
            progress.started = True
            yield chunk(ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=echo)))
    final: RequestOutput | None = None
    async for _, output in group.outputs():
        final = output
        for c in output.outputs:
            if not sent[c.index].has_news(c):
                continue
            _, num_tokens, first = sent[c.index].advance(c)
            delta = texts[c.index].delta(c, first)
            yield chunk(ChatChunkChoice(index=c.index, delta=delta, finish_reason=_finish_reason(c, plan),
                                        logprobs=_logprobs(c, num_tokens, num_logprobs,
                                                           body.return_tokens_as_token_ids)))
    if body.include_usage_in_stream and final is not None:
        yield sse(ChatCompletionChunk(id=request_id, model=model, choices=[], usage=usage([final])),
                  exclude_none=True)


def _logprobs(completion: CompletionOutput, num_tokens: int, num_top: int | None,
              as_token_ids: bool) -> ChatLogprobs | None:
    """The chat-style logprobs of the completion's tokens from num_tokens on."""
    if num_top is None:
        return None
    # NOTE: the engine appends to this list as it runs; read only the tokens this output has.
    positions = (completion.logprobs or [])[num_tokens : len(completion.token_ids)]
    return ChatLogprobs(content=[_token_logprob(token_id, position, num_top, as_token_ids)
                                 for token_id, position in zip(completion.token_ids[num_tokens:], positions,
                                                               strict=True)])


def _token_logprob(token_id: int, position: PositionLogprobs, num_top: int, as_token_ids: bool) -> ChatTokenLogprob:
    entry = position[token_id]
    ranked = sorted(((i, lp) for i, lp in position.items() if lp.rank is not None and lp.rank <= num_top),
                    key=lambda item: item[1].rank)
    top = [TopLogprob(token=token_name(i, lp.decoded_token or "", as_token_ids), logprob=lp.logprob,
                      bytes=_bytes(lp.decoded_token))
           for i, lp in ranked]
    token = entry.decoded_token or ""
    return ChatTokenLogprob(token=token_name(token_id, token, as_token_ids), logprob=entry.logprob,
                            bytes=_bytes(token), top_logprobs=top)


def _bytes(text: str | None) -> list[int]:
    return list((text or "").encode("utf-8"))
