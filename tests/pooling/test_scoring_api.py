"""POST /score, /rerank and /classify served by a tiny random Qwen3 reranker (yes/no logits), against
transformers; /rerank and /score of an embedding model are the cosine similarities of sentence-transformers'."""

from __future__ import annotations

import json

import pytest
import torch

from kvforge.engine.async_engine import AsyncEngine
from kvforge.engine.engines import create_engine
from kvforge.engine_args import build_engine_config
from kvforge.server.app import ServerConfig
from tests.server.harness import MODEL_NAME, ServerThread
from tests.tiny_models import save_model

QUERY = "capital of France"
DOCUMENTS = ["Paris is the capital", "the lazy dog", "def add(a, b)"]


def _serve(model_dir) -> ServerThread:
    engine = create_engine(build_engine_config(model=str(model_dir)))
    return ServerThread(AsyncEngine(engine), ServerConfig((MODEL_NAME,)))


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-reranker")
    model = save_model(folder, "qwen3")
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["Qwen3ForSequenceClassification"], classifier_from_token=["Ġthe", "is"],
                  id2label={"0": "relevant"})
    (folder / "config.json").write_text(json.dumps(config))
    server = _serve(folder)
    yield server, model
    server.stop()


def _expected_scores(server: ServerThread, model, query: str, documents: list[str]) -> list[float]:
    tokenizer = server.engine.tokenizer
    no, yes = tokenizer.token_id("Ġthe"), tokenizer.token_id("is")
    scores = []
    for document in documents:
        with torch.no_grad():
            logits = model(torch.tensor([tokenizer.encode_pair(query, document)[0]])).logits[0, -1]
        scores.append(logits[[no, yes]].softmax(-1)[1].item())
    return scores


def test_score_and_rerank_shapes(reranker):
    server, model = reranker
    expected = _expected_scores(server, model, QUERY, DOCUMENTS)
    scored = server.http.post("/score", json={"model": MODEL_NAME, "text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [d["index"] for d in scored["data"]] == [0, 1, 2]
    assert [d["score"] for d in scored["data"]] == pytest.approx(expected, abs=1e-5)
    assert scored["usage"]["prompt_tokens"] > 0
    # Jina / Cohere: documents as texts or {"text": ...}, results best first, top_n of them
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = {"model": MODEL_NAME, "query": QUERY, "documents": [DOCUMENTS[0], {"text": DOCUMENTS[1]}, DOCUMENTS[2]],
                "top_n": 2}
        results = server.http.post(path, json=body).json()["results"]
        order = sorted(range(3), key=lambda i: -expected[i])[:2]
        assert [r["index"] for r in results] == order
        assert [r["relevance_score"] for r in results] == pytest.approx([expected[i] for i in order], abs=1e-5)
        assert [r["document"]["text"] for r in results] == [DOCUMENTS[i] for i in order]
    classified = server.http.post("/classify", json={"model": MODEL_NAME, "input": ["Paris", "dog"]}).json()
    assert [d["label"] for d in classified["data"]] == ["relevant", "relevant"]
    assert [d["num_classes"] for d in classified["data"]] == [1, 1]


def test_bad_scoring_requests(reranker):
    server, _ = reranker
    pairs = server.http.post("/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert pairs.status_code == 400 and "2 queries and 3 documents" in pairs.json()["error"]["message"]
    empty = server.http.post("/rerank", json={"query": "a", "documents": []})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "documents"
    embed = server.http.post("/v1/embeddings", json={"input": "a"})
    assert embed.status_code == 200  # a reranker is a pooling model too: its last hidden state
    # a field no pooling route takes is refused, naming it; one that changes nothing is named in a header
    bodies = {"/v1/embeddings": {"input": "a"}, "/score": {"text_1": "a", "text_2": "b"},
              "/rerank": {"query": "a", "documents": ["b"]}, "/classify": {"input": "a"}}
    for path, body in bodies.items():
        unknown = server.http.post(path, json={**body, "rank_fields": ["text"]})
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "rank_fields", path
        ignored = server.http.post(path, json={**body, "priority": 1})
        assert ignored.status_code == 200 and ignored.headers["kvforge-ignored-fields"] == "priority", path
