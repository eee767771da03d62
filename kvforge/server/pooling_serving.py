"""What the pooling routes share: the pooling engine, inputs as prompts of token ids, and running them as one
request."""

from __future__ import annotations

from fastapi import Request

from kvforge.engine.pooling_engine import PoolingEngine
from kvforge.outputs import PoolingRequestOutput
from kvforge.pooling_params import PoolingParams
from kvforge.server.errors import APIError
from kvforge.server.pooling_protocol import PoolingUsage
from kvforge.server.serving import RequestGroup, ServerState, off_loop_if_large


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
    """Queue every input, then wait for all their outputs (serving.RequestGroup: if any input is refused, none
    stays queued and the refusal, naming `param`, is the answer; a client that disconnects aborts them all)."""
    group = RequestGroup(state)
    await group.start(request_id, [(prompt, params) for prompt in inputs], input_param=param)
    return await group.final_outputs(http_request)


def pooling_usage(outputs: list[PoolingRequestOutput]) -> PoolingUsage:
    num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return PoolingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
