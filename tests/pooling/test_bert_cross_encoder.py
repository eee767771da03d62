"""A tiny random BERT cross-encoder (BertForSequenceClassification with all-MiniLM-L6-v2's WordPiece tokenizer, the
layout of ms-marco-MiniLM-style rerankers): LLM.score and /rerank and /score against transformers and
sentence-transformers' CrossEncoder."""

from __future__ import annotations

import shutil

import pytest
import torch

from kvforge import LLM
from kvforge.engine.async_engine import AsyncEngine
from kvforge.engine.engines import create_engine
from kvforge.engine_args import build_engine_config
from kvforge.server.app import ServerConfig
from tests.server.harness import MODEL_NAME, ServerThread, metric

QUERY = "how do paged caches work"
DOCUMENTS = ["Paged attention keeps keys and values in fixed-size blocks.", "A monkey is playing drums.",
             "blocks", "The girl is carrying a baby; the cache of the engine is paged."]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory, minilm_dir):
    import transformers

    folder = tmp_path_factory.mktemp("bert-cross-encoder")
    for name in _TOKENIZER_FILES:
        shutil.copy(minilm_dir / name, folder / name)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64, num_labels=1,
                                     initializer_range=0.2)  # scores far apart: their order means something
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()
    with torch.no_grad():  # token types must matter: make type 1's embedding far from type 0's
        model.bert.embeddings.token_type_embeddings.weight[1].normal_(0, 1)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def transformers_model(cross_encoder_dir):
    import transformers

    return transformers.BertForSequenceClassification.from_pretrained(cross_encoder_dir).eval()


@pytest.fixture(scope="module")
def reference_scores(cross_encoder_dir, transformers_model) -> list[float]:
    """transformers' sigmoid of the head's logit for each (QUERY, document), its tokenizer's pair encoding."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(cross_encoder_dir)
    model = transformers_model
    batch = tokenizer([QUERY] * len(DOCUMENTS), DOCUMENTS, padding=True, return_tensors="pt")
    assert batch["token_type_ids"].any()  # the documents' tokens are of type 1
    with torch.no_grad():
        scores = model(**batch).logits[:, 0].sigmoid().tolist()
    assert min(abs(a - b) for i, a in enumerate(scores) for b in scores[:i]) > 1e-3
    return scores


@pytest.fixture(scope="module")
def llm(cross_encoder_dir):
    with LLM(str(cross_encoder_dir)) as llm:  # runner auto: the architecture only classifies
        yield llm


def test_score_matches_transformers_and_cross_encoder(llm, cross_encoder_dir, transformers_model, reference_scores):
    from sentence_transformers import CrossEncoder

    scores = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS)]
    assert scores == pytest.approx(reference_scores, abs=1e-5)
    cross_encoder = CrossEncoder(str(cross_encoder_dir), device="cpu")
    predicted = cross_encoder.predict([(QUERY, d) for d in DOCUMENTS])
    assert scores == pytest.approx(predicted.tolist(), abs=1e-5)
    # truncate_prompt_tokens keeps a pair's last tokens, their types with them
    (cut,) = llm.score(QUERY, DOCUMENTS[0], truncate_prompt_tokens=9)
    token_ids, token_type_ids = llm.get_tokenizer().encode_pair(QUERY, DOCUMENTS[0])
    assert cut.prompt_token_ids == token_ids[-9:]
    with torch.no_grad():
        logit = transformers_model(torch.tensor([token_ids[-9:]]), token_type_ids=torch.tensor([token_type_ids[-9:]]))
    assert cut.outputs.score == pytest.approx(logit.logits[0, 0].sigmoid().item(), abs=1e-5)
    # pairs in order, and the pair's own order matters (the query's tokens are type 0)
    (swapped,) = llm.score(DOCUMENTS[0], QUERY)
    assert abs(swapped.outputs.score - scores[0]) > 1e-4


def test_rerank_and_score_routes(cross_encoder_dir, reference_scores):
    engine = create_engine(build_engine_config(model=str(cross_encoder_dir)))
    server = ServerThread(AsyncEngine(engine), ServerConfig((MODEL_NAME,)))
    try:
        results = server.http.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 3}).json()
        order = sorted(range(len(DOCUMENTS)), key=lambda i: -reference_scores[i])[:3]
        assert [r["index"] for r in results["results"]] == order
        assert [r["relevance_score"] for r in results["results"]] == pytest.approx(
            [reference_scores[i] for i in order], abs=1e-5)
        scored = server.http.post("/score", json={"text_1": QUERY, "text_2": DOCUMENTS}).json()
        assert [d["score"] for d in scored["data"]] == pytest.approx(reference_scores, abs=1e-5)
        # /metrics counts every pair of both requests, and their tokens, as it counts generation requests
        num_prompt_tokens = results["usage"]["prompt_tokens"] + scored["usage"]["prompt_tokens"]
        assert metric(server.http, 'kvforge:request_success_total{finished_reason="stop"}') == 2 * len(DOCUMENTS)
        assert metric(server.http, "kvforge:prompt_tokens_total") == num_prompt_tokens > 0
        refused = server.http.post("/rerank", json={"query": QUERY, "documents": ["a", "b " * 100]})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "documents"
        assert "documents[1]" in refused.json()["error"]["message"]
        assert metric(server.http, "kvforge:prompt_tokens_total") == num_prompt_tokens  # refused: nothing counted
    finally:
        server.stop()
