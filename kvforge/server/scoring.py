"""POST /score (vLLM's shape), /rerank (Jina's and Cohere's, also under /v1 and /v2) and /classify."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from kvforge.engine.pooling_engine import PoolingEngine
from kvforge.engine.scoring import cosine_scores, pair_prompts, pair_up
from kvforge.outputs import PoolingRequestOutput
from kvforge.pooling_params import PoolingParams
from kvforge.server.errors import APIError
from kvforge.server.pooling_protocol import (
    ClassifyData,
    ClassifyRequest,
    ClassifyResponse,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from kvforge.server.pooling_serving import input_prompts, pooling_engine, pooling_usage, run_pooling
from kvforge.server.request_fields import check_fields
from kvforge.server.serving import ServerState, json_response, new_request_id

router = APIRouter()


async def _scores(state: ServerState, engine: PoolingEngine, request_id: str, queries: str | list[str],
                  documents: str | list[str], truncate_prompt_tokens: int | None,
                  http_request: Request) -> list[PoolingRequestOutput]:
    try:
        queries, documents = pair_up(queries, documents)
    except ValueError as error:
        raise APIError(400, str(error)) from error
    if engine.has_classifier:
        inputs = pair_prompts(engine.tokenizer, queries, documents)
        params = PoolingParams("score", truncate_prompt_tokens=truncate_prompt_tokens)
        return await run_pooling(state, request_id, inputs, params, http_request, param="documents")
    inputs = await input_prompts(state, queries + documents, param="documents")
    params = PoolingParams("embed", truncate_prompt_tokens=truncate_prompt_tokens)
    return cosine_scores(await run_pooling(state, request_id, inputs, params, http_request, param="documents"))


@router.post("/score", response_model=ScoreResponse)
@router.post("/v1/score", response_model=ScoreResponse)
async def score(body: ScoreRequest, http_request: Request) -> Response:
    state: ServerState = http_request.app.state.server
    model = state.check_model(body.model)
    engine = pooling_engine(state, "/score")
    headers = check_fields(body)
    request_id = new_request_id("score")
    outputs = await _scores(state, engine, request_id, body.text_1, body.text_2, body.truncate_prompt_tokens,
                            http_request)
    data = [ScoreData(index=i, score=o.outputs.score) for i, o in enumerate(outputs)]
    return json_response(ScoreResponse(id=request_id, model=model, data=data, usage=pooling_usage(outputs)), headers)


@router.post("/rerank", response_model=RerankResponse)
@router.post("/v1/rerank", response_model=RerankResponse)
@router.post("/v2/rerank", response_model=RerankResponse)
async def rerank(body: RerankRequest, http_request: Request) -> Response:
    state: ServerState = http_request.app.state.server
    model = state.check_model(body.model)
    engine = pooling_engine(state, "/rerank")
    headers = check_fields(body)
    request_id = new_request_id("rerank")
    texts = [d if isinstance(d, str) else d.text for d in body.documents]
    if not texts:
        raise APIError(400, "documents must not be empty", param="documents")
    outputs = await _scores(state, engine, request_id, body.query, texts, body.truncate_prompt_tokens,
                            http_request)
    results = [RerankResult(index=i, relevance_score=o.outputs.score,
                            document=RerankDocument(text=texts[i]) if body.return_documents else None)
               for i, o in enumerate(outputs)]
    results.sort(key=lambda r: r.relevance_score, reverse=True)
    response = RerankResponse(id=request_id, model=model, results=results[: body.top_n], usage=pooling_usage(outputs))
    return json_response(response, headers)


@router.post("/classify", response_model=ClassifyResponse)
@router.post("/v1/classify", response_model=ClassifyResponse)
async def classify(body: ClassifyRequest, http_request: Request) -> Response:
    state: ServerState = http_request.app.state.server
    model = state.check_model(body.model)
    engine = pooling_engine(state, "/classify")
    headers = check_fields(body)
    params = PoolingParams("classify", truncate_prompt_tokens=body.truncate_prompt_tokens)
    try:
        engine.check_params(params)
    except ValueError as error:
        raise APIError(400, str(error)) from error
    request_id = new_request_id("classify")
    outputs = await run_pooling(state, request_id, await input_prompts(state, body.input), params, http_request)
    labels = engine.hf_config.get("id2label") or {}
    data = []
    for i, output in enumerate(outputs):
        probs = output.outputs.probs
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append(ClassifyData(index=i, label=labels.get(str(best), f"LABEL_{best}"), probs=probs,
                                 num_classes=len(probs)))
    return json_response(ClassifyResponse(id=request_id, model=model, data=data, usage=pooling_usage(outputs)), headers)
