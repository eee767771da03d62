"""POST /v1/embeddings with all-MiniLM-L6-v2, through the official openai client, against sentence-transformers."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F

from kvforge.engine.async_engine import AsyncEngine
from kvforge.engine.engines import create_engine
from kvforge.engine.pooling_engine import PoolingEngine
from kvforge.engine_args import build_engine_config
from kvforge.server.app import ServerConfig
from tests.pooling.conftest import SENTENCES
from tests.server.harness import API_KEY, MODEL_NAME, ServerThread


@pytest.fixture(scope="module")
def server(minilm_dir):
    engine = create_engine(build_engine_config(model=str(minilm_dir)))  # runner auto: modules.json says pooling
    assert isinstance(engine, PoolingEngine)
    server = ServerThread(AsyncEngine(engine), ServerConfig((MODEL_NAME,), api_key=API_KEY))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai_client()


def _matrix(response) -> torch.Tensor:
    assert [d.index for d in response.data] == list(range(len(response.data)))
    return torch.tensor([d.embedding for d in response.data])


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_openai_client_embeddings_match_sentence_transformers(client, minilm_reference, encoding_format):
    # NOTE: without encoding_format the client asks for base64 and decodes it itself
    kwargs = {"encoding_format": "float"} if encoding_format == "float" else {}
    response = client.embeddings.create(model=MODEL_NAME, input=SENTENCES, **kwargs)
    assert F.cosine_similarity(_matrix(response), minilm_reference).min().item() >= 0.9999
    assert response.usage.prompt_tokens == response.usage.total_tokens > len(SENTENCES)
    assert response.model == MODEL_NAME


def test_one_text_token_ids_and_dimensions(client, server, minilm_reference):
    single = client.embeddings.create(model=MODEL_NAME, input=SENTENCES[0], encoding_format="float")
    assert F.cosine_similarity(_matrix(single), minilm_reference[:1]).item() >= 0.9999
    token_ids = server.engine.tokenizer.encode(SENTENCES[1])
    by_ids = client.embeddings.create(model=MODEL_NAME, input=[token_ids, token_ids], encoding_format="float")
    assert F.cosine_similarity(_matrix(by_ids), minilm_reference[1:2].expand(2, -1)).min().item() >= 0.9999
    short = client.embeddings.create(model=MODEL_NAME, input=SENTENCES[:2], dimensions=64)
    expected = F.normalize(minilm_reference[:2, :64], dim=1)
    assert F.cosine_similarity(_matrix(short), expected).min().item() >= 0.9999
    raw = server.http.post("/v1/embeddings", headers={"Authorization": f"Bearer {API_KEY}"},
                           json={"input": "x", "encoding_format": "base64", "dimensions": 8}).json()
    assert np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4").shape == (8,)


def test_bad_inputs_are_400s_naming_the_problem(client, server):
    too_long = "tokens " * 300
    with pytest.raises(openai.BadRequestError, match="window is 256 tokens") as error:
        client.embeddings.create(model=MODEL_NAME, input=["fine", too_long])
    assert error.value.body["param"] == "input"
    assert "input[1]" in error.value.body["message"]
    cut = client.embeddings.create(model=MODEL_NAME, input=too_long, encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": 100})
    assert cut.usage.prompt_tokens == 100
    with pytest.raises(openai.BadRequestError, match="at most the model's 384"):
        client.embeddings.create(model=MODEL_NAME, input="x", dimensions=1000)
    with pytest.raises(openai.BadRequestError, match=r"\[0, 30522\)"):
        client.embeddings.create(model=MODEL_NAME, input=[[5, 40000]])
    with pytest.raises(openai.BadRequestError, match="empty"):
        client.embeddings.create(model=MODEL_NAME, input=[])
    with pytest.raises(openai.BadRequestError, match="runner 'pooling'"):
        client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=2)
    assert server.engine.stats.num_unfinished == 0  # nothing refused stayed queued


def test_rerank_and_score_of_an_embedding_model_are_cosine_similarities(server, minilm_reference):
    results = server.http.post("/rerank", json={"query": SENTENCES[0], "documents": SENTENCES[1:4]},
                               headers={"Authorization": f"Bearer {API_KEY}"}).json()["results"]
    cosine = F.cosine_similarity(minilm_reference[:1], minilm_reference[1:4]).tolist()
    assert [r["index"] for r in results] == sorted(range(3), key=lambda i: -cosine[i])
    # NOTE: within the ~1.5e-3 that bfloat16 products (the default where the CPU has AMX) move a cosine by
    assert [r["relevance_score"] for r in sorted(results, key=lambda r: r["index"])] == pytest.approx(cosine, abs=2e-3)
    refused = server.http.post("/classify", json={"input": "x"}, headers={"Authorization": f"Bearer {API_KEY}"})
    assert refused.status_code == 400 and "no classifier head" in refused.json()["error"]["message"]
