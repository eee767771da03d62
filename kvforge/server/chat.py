"""POST /v1/chat/completions: messages through the model's chat template, streamed or not, with logprobs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from fastapi import APIRouter, Request
from starlette.responses import Response

from kvforge.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from kvforge.reasoning.harmony import HarmonyParser
from kvforge.reasoning.registry import expects_reasoning, reasoning_parser, template_reasoning_parser
from kvforge.server.chat_prompt import chat_prompt_token_ids
from kvforge.server.chat_reply import ReplyFormat, ReplyStream
from kvforge.server.errors import APIError
from kvforge.server.logprob_views import prompt_logprobs, token_name
from kvforge.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    DeltaMessage,
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
from kvforge.server.tool_formats import HARMONY
from kvforge.server.tools import ToolPlan, plan_tools, special_ids
from kvforge.structured_output.params import ANY_JSON_OBJECT, StructuredOutputParams, schema_as_enforced
from kvforge.tokenizer import Tokenizer

router = APIRouter()


def _message_dict(message: ChatMessage) -> dict:
    fields = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):
        fields["content"] = "\n".join(part.text for part in message.content)
    return fields


def _check_values(body: ChatCompletionRequest) -> None:
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")


def _response_format(body: ChatCompletionRequest, reply: ReplyFormat,
                     tokenizer: Tokenizer) -> StructuredOutputParams | None:
    """The constraint response_format asks for (`strict` or not, the schema is enforced); for a harmony reply, on
    its final message's text."""
    response_format = body.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        constraint = StructuredOutputParams(json_object=True)
    elif response_format.json_schema is None:
        raise APIError(400, "response_format json_schema needs its json_schema field", param="response_format")
    else:
        constraint = StructuredOutputParams(json=response_format.json_schema.json_schema)
    if not isinstance(reply.reasoning, HarmonyParser):
        return constraint
    schema = schema_as_enforced(ANY_JSON_OBJECT if constraint.json_object else constraint.json)
    return StructuredOutputParams(grammar=HARMONY.text_grammar(schema, special_ids(HARMONY, tokenizer)))


def _reply_format(state: ServerState, body: ChatCompletionRequest, plan: ToolPlan) -> ReplyFormat:
    """The server's reasoning parser (or harmony's, which a chat template that writes channels implies) and the
    format calls are read in. A request that turns thinking off has no reasoning to part (a harmony reply still
    has its channels)."""
    name = state.engine.engine.config.model.reasoning_parser
    parser = reasoning_parser(name) if name is not None else template_reasoning_parser(
        state.engine.tokenizer.chat_template)
    if not isinstance(parser, HarmonyParser) and not expects_reasoning(body.chat_template_kwargs):
        parser = None
    return ReplyFormat(parser, plan.calls)


def _num_logprobs(body: ChatCompletionRequest) -> int | None:
    return (body.top_logprobs or 0) if body.logprobs else None


@dataclass(slots=True)
class ChatRun:
    """A chat request queued in the engine: its engine requests, how its replies are read and its messages."""

    group: RequestGroup
    reply: ReplyFormat
    messages: list[dict]


async def start_chat(state: ServerState, body: ChatCompletionRequest, request_id: str) -> ChatRun:
    """Render body's messages through the chat template (tools included), build its sampling parameters and
    queue it; 400 for a bad value. POST /v1/responses runs its requests through here too."""
    _check_values(body)
    tokenizer = state.engine.tokenizer
    messages = [_message_dict(m) for m in body.messages]
    plan = plan_tools(body, messages, tokenizer)
    token_ids = await chat_prompt_token_ids(tokenizer, plan.messages, body.add_generation_prompt,
                                            body.continue_final_message, body.chat_template_kwargs,
                                            plan.template_kwargs)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    reply = _reply_format(state, body, plan)
    constraint = plan.structured_output or _response_format(body, reply, tokenizer)
    params = sampling_params(state, body, max_tokens_in_context(state, len(token_ids), requested),
                             logprobs=_num_logprobs(body), prompt_logprobs=body.prompt_logprobs,
                             **({} if constraint is None else {"structured_output": constraint}))
    if reply.special_tokens:  # the reply is read for special tokens
        params.skip_special_tokens = False
    if reply.reasoning is not None and reply.reasoning.end is not None and params.structured_output is not None:
        # constrain what follows the reasoning
        params.structured_output = replace(params.structured_output, starts_after=reply.reasoning.end)
    group = RequestGroup(state)
    await group.start(request_id, [({"prompt_token_ids": token_ids}, params)], lora=state.lora_for(body.model))
    return ChatRun(group, reply, messages)


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, http_request: Request) -> Response:
    state: ServerState = http_request.app.state.server
    model = state.check_model(body.model)
    headers = check_fields(body)
    num_logprobs = _num_logprobs(body)
    request_id = new_request_id("chatcmpl")
    run = await start_chat(state, body, request_id)
    group, reply = run.group, run.reply
    echo = _echo(body, run.messages)
    if body.stream:
        return sse_response(group, _stream(group, body, reply, echo, request_id, model), headers)
    (output,) = await group.final_outputs(http_request)
    choices = [ChatChoice(index=c.index, message=reply.message(c, echo), finish_reason=reply.finish_reason(c),
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


async def _stream(group: RequestGroup, body: ChatCompletionRequest, reply: ReplyFormat, echo: str,
                  request_id: str, model: str) -> AsyncIterator[str]:
    num_logprobs = _num_logprobs(body)

    def chunk(choice: ChatChunkChoice) -> str:
        return sse(ChatCompletionChunk(id=request_id, model=model, choices=[choice]), exclude_none=True)

    sent = [ChoiceProgress() for _ in range(body.n)]
    replies = [ReplyStream(reply, role_sent=bool(echo)) for _ in range(body.n)]
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
            finish_reason = reply.finish_reason(c)
            logprobs = _logprobs(c, num_tokens, num_logprobs, body.return_tokens_as_token_ids)
            # NOTE: one delta per part (reasoning, then content or calls); the last carries the step's logprobs.
            # A step that adds nothing sends nothing, but for a choice's first (its role) and last.
            at_least_one = first or finish_reason is not None or logprobs is not None
            deltas = replies[c.index].deltas(c, at_least_one=at_least_one)
            for number, delta in enumerate(deltas, start=1):
                last = number == len(deltas)
                yield chunk(ChatChunkChoice(index=c.index, delta=delta, finish_reason=finish_reason if last else None,
                                            logprobs=logprobs if last else None))
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
