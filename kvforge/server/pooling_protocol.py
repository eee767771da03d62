"""Request and response bodies of the pooling routes: OpenAI's /v1/embeddings, and /score, /rerank and /classify
in the shapes vLLM's and Jina's / Cohere's clients send."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvforge.server.protocol import Text

# text, texts, token ids, or lists of token ids
Inputs = Text | list[Text] | list[int] | list[list[int]]


class PoolingRequest(BaseModel):
    """Fields every pooling request shares. Other fields are kept in `model_extra`, and request_fields.check_fields
    refuses them or reports them ignored, as on the other routes."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    user: str | None = None
    # keep an input's last k tokens (-1: as many as the model's window holds) instead of refusing a longer one
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | Literal[-1] | None = None


class EmbeddingRequest(PoolingRequest):
    input: Inputs
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    normalize: bool | None = None  # vLLM's extra: None keeps the checkpoint's choice


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: the little-endian float32 bytes


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class ClassifyRequest(PoolingRequest):
    input: Inputs


class ClassifyData(BaseModel):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassifyResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassifyData]
    usage: PoolingUsage


class ScoreRequest(PoolingRequest):
    """vLLM's /score: text_1 against each of text_2 (or pairs in order when both are lists)."""

    text_1: Text | list[Text]
    text_2: Text | list[Text]


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocumentObject(BaseModel):
    text: Text


class RerankRequest(PoolingRequest):
    """Jina's and Cohere's /rerank (and vLLM's): a query, its documents (texts, or {"text": ...}), the top n."""

    query: Text
    documents: list[Text | RerankDocumentObject]
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: PoolingUsage
