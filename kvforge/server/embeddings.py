"""POST /v1/embeddings in OpenAI's shape: texts or token ids, one or many, as floats or base64."""

from __future__ import annotations

import base64

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import Response

from kvforge.pooling_params import PoolingParams
from kvforge.server.errors import APIError
from kvforge.server.pooling_protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse
from kvforge.server.pooling_serving import input_prompts, pooling_engine, pooling_usage, run_pooling
from kvforge.server.request_fields import check_fields
from kvforge.server.serving import ServerState, json_response, new_request_id

router = APIRouter()


def _encoded(values: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return values
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")


@router.post("/v1/embeddings", response_model=EmbeddingResponse)
async def create_embeddings(body: EmbeddingRequest, http_request: Request) -> Response:
    state: ServerState = http_request.app.state.server
    model = state.check_model(body.model)
    engine = pooling_engine(state, "/v1/embeddings")
    headers = check_fields(body)
    try:
        params = PoolingParams("embed", body.dimensions, body.normalize, body.truncate_prompt_tokens)
        engine.check_params(params)
    except ValueError as error:
        raise APIError(400, str(error), param="dimensions" if body.dimensions else None) from error
    inputs = await input_prompts(state, body.input)
    request_id = new_request_id("embd")
    outputs = await run_pooling(state, request_id, inputs, params, http_request)
    data = [EmbeddingData(index=i, embedding=_encoded(o.outputs.embedding, body.encoding_format))
            for i, o in enumerate(outputs)]
    response = EmbeddingResponse(id=request_id, model=model, data=data, usage=pooling_usage(outputs))
    return json_response(response, headers)
