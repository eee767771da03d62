"""What the pooling routes share: the pooling engine, inputs as token ids, and running them as one request."""

from __future__ import annotations

import asyncio

from fastapi import Request

from kvforge.engine.async_engine import RequestStream
from kvforge.engine.pooling_engine import PoolingEngine
from kvforge.outputs import PoolingRequestOutput
from kvforge.pooling_params import PoolingParams
from kvforge.server.errors import APIError, as_api_error
from kvforge.server.pooling_protocol import PoolingUsage
from kvforge.server.serving import ServerState, off_loop_if_large, wait_for_disconnect


def pooling_engine(state: ServerState, route: str) -> PoolingEngine:
    """The server's engine when it pools; 400 naming the runner when it generates."""
    engine = state.engine.engine
    if not isinstance(engine, PoolingEngine):
        raise APIError(400, f"{route} needs a pooling model; this server runs {state.model_names[0]!r} with runner "
                            f"'generate' (serve a pooling model, or this one with --runner pooling)")
    return engine


async def input_prompts(state: ServerState, inputs: str | list, param: str = "input") -> list[dict]:
    """An API input (text, texts, token ids, lists of token ids) as one prompt ({"prompt_token_ids": ...}) per
    input."""
    if isinstance(inputs, str):
        inputs = [inputs]
    elif not inputs:
        raise APIError(400, f"{param} must not be an empty list", param=param)
    if isinstance(inputs[0], int):
        return [{"prompt_token_ids": list(inputs)}]
    if isinstance(inputs[0], str):
        encode = state.engine.tokenizer.encode
        return await off_loop_if_large(sum(len(text) for text in inputs),
                                       lambda: [{"prompt_token_ids": encode(text)} for text in inputs])
    return [{"prompt_token_ids": list(token_ids)} for token_ids in inputs]


async def run_pooling(state: ServerState, request_id: str, inputs: list[dict], params: PoolingParams,
                      http_request: Request, param: str = "input") -> list[PoolingRequestOutput]:
    """Queue every input, then wait for all their outputs. If any input is refused (too long, say), none stays
    queued and the refusal is the answer; a client that disconnects aborts them all."""
    engine = state.engine
    limit = state.max_admitted_sequences
    if len(inputs) > limit:
        raise APIError(400, f"the request has {len(inputs)} inputs, but the server admits at most {limit} at once; "
                            f"send fewer per request", param=param)
    results = await asyncio.gather(
        *(engine.add_request(f"{request_id}-{i}", prompt, params) for i, prompt in enumerate(inputs)),
        return_exceptions=True)
    streams = [r for r in results if isinstance(r, RequestStream)]
    errors = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
    if errors:
        for stream in streams:
            stream.abort()
        index, error = errors[0]
        if not isinstance(error, Exception):
            raise error
        if isinstance(error, ValueError):
            message = f"{param}[{index}]: {error}" if len(inputs) > 1 else str(error)
            raise APIError(400, message, param=param) from error
        raise as_api_error(error) from error
    collect = asyncio.ensure_future(asyncio.gather(*(anext(stream) for stream in streams)))
    disconnected = asyncio.ensure_future(wait_for_disconnect(http_request))
    try:
        await asyncio.wait({collect, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnected.cancel()
    if not collect.done():
        collect.cancel()
        for stream in streams:
            stream.abort()
        raise APIError(499, "the client closed the request")
    try:
        return collect.result()
    except Exception as error:
        raise as_api_error(error) from error


def pooling_usage(outputs: list[PoolingRequestOutput]) -> PoolingUsage:
    num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return PoolingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
