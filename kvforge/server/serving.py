"""What the routes share: validation, admission (the generation and pooling routes alike), output streams, SSE,
usage."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvforge.engine.async_engine import AsyncEngine, EngineOverloadedError, RequestStream
from kvforge.lora.request import LoRARequest
from kvforge.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
from kvforge.pooling_params import PoolingParams
from kvforge.sampling_params import SamplingParams
from kvforge.server.errors import RETRY_AFTER_SECONDS, APIError, as_api_error, error_body
from kvforge.server.lifecycle import ShutdownDeadline
from kvforge.server.lora_adapters import LoRAAdapters
from kvforge.server.metrics import RequestTracker, ServerMetrics
from kvforge.server.protocol import PromptTokensDetails, SamplingRequest, Usage
from kvforge.structured_output.params import StructuredOutputParams

SSE_DONE = "data: [DONE]\n\n"
# Inputs of this many characters or more are tokenized (or templated) in a worker thread, so the
# event loop goes on serving other requests meanwhile; smaller ones are quicker than the hand-off.
LARGE_INPUT_CHARS = 16384
_T = TypeVar("_T")


@dataclass(slots=True)
class ServerState:
    """What every route needs, held in `app.state.server`."""

    engine: AsyncEngine
    metrics: ServerMetrics
    model_names: tuple[str, ...]  # the first one is the name /v1/models lists first
    vocab_size: int
    shutdown_deadline: ShutdownDeadline
    adapters: LoRAAdapters  # the LoRA adapters served beside the base model, by name

    @property
    def max_admitted_sequences(self) -> int:
        """The most sequences one request may have: every batch slot plus the whole queue."""
        return self.engine.engine.config.scheduler.max_num_seqs + self.engine.max_queue

    def check_model(self, name: str | None) -> str:
        """The served name a request asked for (None: the default), the base model's or a LoRA adapter's; 404 for
        any other."""
        if name is None:
            return self.model_names[0]
        if name not in self.model_names and name not in self.adapters.by_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{[*self.model_names, *self.adapters.by_name]}", param="model",
                           code="model_not_found")
        return name

    def lora_for(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter a checked model name runs (None: the base model)."""
        return self.adapters.by_name.get(name)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def off_loop_if_large(num_chars: int, fn: Callable[..., _T], *args: object, **kwargs: object) -> _T:
    """fn(*args, **kwargs), in a worker thread when the input has LARGE_INPUT_CHARS or more."""
    if num_chars < LARGE_INPUT_CHARS:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


def sampling_params(state: ServerState, request: SamplingRequest, max_tokens: int,
                    **extra: object) -> SamplingParams:
    """SamplingParams from the request's fields; 400 with the engine's message for a bad value."""
    if request.prompt_logprobs is not None and request.stream:
        raise APIError(400, "prompt_logprobs cannot be streamed; ask without stream", param="prompt_logprobs")
    if request.structured_outputs is not None:
        extra["structured_output"] = _structured_outputs(request, extra.get("structured_output"))
    bad_ids = [t for t in request.stop_token_ids or [] if not 0 <= t < state.vocab_size]
    if bad_ids:
        raise APIError(400, f"stop_token_ids must be in [0, {state.vocab_size}), got {bad_ids}",
                       param="stop_token_ids")
    try:
        return SamplingParams(
            n=request.n, temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
            min_p=request.min_p, presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty, repetition_penalty=request.repetition_penalty,
            seed=request.seed, max_tokens=max_tokens, min_tokens=request.min_tokens, stop=request.stop or [],
            stop_token_ids=request.stop_token_ids or [], ignore_eos=request.ignore_eos,
            skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            logit_bias=_logit_bias(state, request.logit_bias), guided_json=request.guided_json,
            guided_regex=request.guided_regex, guided_choice=request.guided_choice,
            guided_grammar=request.guided_grammar, **extra,
        )
    except ValueError as error:
        raise APIError(400, str(error)) from error


def _structured_outputs(request: SamplingRequest, other: object) -> StructuredOutputParams:
    """The request's `structured_outputs`; 400 if response_format or tools constrain the output too."""
    if other is not None:
        raise APIError(400, "structured_outputs cannot be combined with response_format or tools",
                       param="structured_outputs")
    fields = request.structured_outputs
    try:
        return StructuredOutputParams(json=fields.json_schema, regex=fields.regex, choice=fields.choice,
                                      grammar=fields.grammar, json_object=fields.json_object)
    except ValueError as error:
        raise APIError(400, f"structured_outputs: {error}", param="structured_outputs") from error


def _logit_bias(state: ServerState, logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """The API's {"token id": bias} as {token id: bias}; 400 for a key that is no token id."""
    if not logit_bias:
        return None
    bad = [key for key in logit_bias if not (key.isascii() and key.isdigit()) or not int(key) < state.vocab_size]
    if bad:
        raise APIError(400, f"logit_bias keys must be token ids in [0, {state.vocab_size}), got {bad}",
                       param="logit_bias")
    return {int(key): bias for key, bias in logit_bias.items()}


def max_tokens_in_context(state: ServerState, num_prompt_tokens: int, requested: int | None) -> int:
    """The tokens to generate: as requested (400 if prompt + output would not fit the context), or
    as many as fit when not given. The request model bounds `requested` below (0 for completions)."""
    max_model_len = state.engine.max_model_len
    if num_prompt_tokens == 0:
        raise APIError(400, "the prompt is empty", param="prompt")
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens, but the prompt "
                            f"has {num_prompt_tokens} (at most {max_model_len - 1} leave room for one token "
                            f"to generate); shorten the prompt", param="prompt")
    if requested is not None and requested > room:
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens, but the request "
                            f"needs more ({num_prompt_tokens} in the prompt, {requested} to generate); "
                            f"lower max_tokens to {room} or less, or shorten the prompt", param="max_tokens")
    return room if requested is None else requested


Output = RequestOutput | PoolingRequestOutput


class RequestGroup:
    """The engine requests of one HTTP request (one per prompt, or per input of a pooling request), their metrics,
    and their outputs."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.streams: list[RequestStream] = []
        self.trackers: list[RequestTracker] = []

    async def start(self, request_id: str, prompts: list[tuple[dict, SamplingParams | PoolingParams]],
                    input_param: str | None = None, lora: LoRARequest | None = None) -> None:
        """Queue every prompt (a dict with its "prompt_token_ids") at once; if any is refused, abort the others and
        raise its error. With `input_param` (a pooling request's "input", say) a refusal names that field, and
        which of the inputs it was. lora: the adapter every prompt runs with (None: the base model).

        A request with more sequences (prompts x n) than could ever be admitted is a 400: retrying
        cannot help it, unlike the 503 of a full queue."""
        engine, metrics = self.state.engine, self.state.metrics
        num_sequences = sum(params.n for _, params in prompts)
        limit = self.state.max_admitted_sequences
        if num_sequences > limit:
            metrics.rejected.labels(reason="never_fits").inc()
            raise APIError(400, f"the request has {num_sequences} sequences (prompts x n), but the server admits "
                                f"at most {limit} at once ({limit - engine.max_queue} batch slots and a queue of "
                                f"{engine.max_queue}); lower n or send fewer prompts per request",
                           param=input_param or "n")
        results = await asyncio.gather(
            *(engine.add_request(f"{request_id}-{i}", prompt, params, lora)
              for i, (prompt, params) in enumerate(prompts)),
            return_exceptions=True,
        )
        self.streams = [r for r in results if isinstance(r, RequestStream)]
        errors = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if errors:
            self.abort()
            index, error = errors[0]
            if not isinstance(error, Exception):
                raise error
            if isinstance(error, EngineOverloadedError):
                metrics.rejected.labels(reason="queue_full").inc()
            if isinstance(error, ValueError) and input_param is not None:
                message = f"{input_param}[{index}]: {error}" if len(prompts) > 1 else str(error)
                raise APIError(400, message, param=input_param) from error
            raise as_api_error(error) from error
        lora_name = None if lora is None else lora.name
        self.trackers = [metrics.track(len(prompt["prompt_token_ids"]), lora_name) for prompt, _ in prompts]

    def abort(self) -> None:
        for stream in self.streams:
            stream.abort()

    async def outputs(self) -> AsyncIterator[tuple[int, Output]]:
        """(prompt index, cumulative output) as they come, until every request has finished; raises a
        503 APIError if the server's shutdown deadline passes first."""
        pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(self.streams)}
        deadline = asyncio.ensure_future(self.state.shutdown_deadline.expired.wait())
        try:
            while pending:
                done, _ = await asyncio.wait({*pending, deadline}, return_when=asyncio.FIRST_COMPLETED)
                if deadline in done:
                    raise APIError(503, "the server shut down before the request finished; retry it",
                                   headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
                for task in done:
                    index = pending.pop(task)
                    output = task.result()
                    self.trackers[index].update(output)
                    if not output.finished:
                        pending[asyncio.ensure_future(anext(self.streams[index]))] = index
                    yield index, output
        finally:
            for task in [*pending, deadline]:
                task.cancel()
            self.abort()

    async def final_outputs(self, http_request: Request) -> list[Output]:
        """Every request's finished output; aborts them all if the client disconnects first."""
        collect = asyncio.ensure_future(self._collect())
        disconnected = asyncio.ensure_future(wait_for_disconnect(http_request))
        await asyncio.wait({collect, disconnected}, return_when=asyncio.FIRST_COMPLETED)
        disconnected.cancel()
        if not collect.done():
            collect.cancel()
            await asyncio.gather(collect, return_exceptions=True)
            raise APIError(499, "the client closed the request")
        try:
            return collect.result()
        except Exception as error:
            raise as_api_error(error) from error

    async def _collect(self) -> list[Output]:
        latest: dict[int, Output] = {}
        async for index, output in self.outputs():
            latest[index] = output
        return [latest[index] for index in range(len(self.streams))]


async def wait_for_disconnect(http_request: Request) -> None:
    """Returns once the client has closed the connection."""
    while (await http_request.receive())["type"] != "http.disconnect":
        pass


@dataclass(slots=True)
class ChoiceProgress:
    """How much of one choice a stream has sent. Completions send a chunk for every new token (its text
    may be empty: held back, or a special token), so clients see each token's timing; chat completions
    send only the chunks that carry something (chat_reply.ReplyStream)."""

    num_chars: int = 0
    num_tokens: int = 0
    started: bool = False
    finished: bool = False

    def has_news(self, completion: CompletionOutput) -> bool:
        return not self.finished and (completion.finished or len(completion.token_ids) > self.num_tokens)

    def advance(self, completion: CompletionOutput) -> tuple[int, int, bool]:
        """Mark the completion as sent; returns the characters and tokens sent before, and whether
        this is the choice's first chunk."""
        before = (self.num_chars, self.num_tokens, not self.started)
        self.num_chars, self.num_tokens = len(completion.text), len(completion.token_ids)
        self.started, self.finished = True, completion.finished
        return before


def sse(payload: BaseModel | dict, exclude_none: bool = False) -> str:
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json(exclude_none=exclude_none)}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


def json_response(payload: BaseModel, headers: dict[str, str]) -> Response:
    return JSONResponse(payload.model_dump(mode="json"), headers=headers)


def sse_response(group: RequestGroup, events: AsyncIterator[str], headers: dict[str, str]) -> Response:
    """Stream events, then `data: [DONE]`; an error mid-stream becomes an OpenAI error event.

    The background task aborts whatever is still running once the response ends, however it ends
    (a disconnected client included)."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except Exception as error:
            api_error = as_api_error(error)
            yield sse(error_body(api_error.status, api_error.message, api_error.param, api_error.code))
            return
        yield SSE_DONE

    return StreamingResponse(body(), media_type="text/event-stream", background=BackgroundTask(group.abort),
                             headers={"Cache-Control": "no-cache", **headers})


def usage(outputs: list[RequestOutput]) -> Usage:
    """Token counts over all prompts of a request (each prompt counted once, whatever n)."""
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    num_completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    num_cached = sum(o.num_cached_tokens for o in outputs)
    return Usage(prompt_tokens=num_prompt, completion_tokens=num_completion,
                 total_tokens=num_prompt + num_completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached))
