"""Tiny random Qwen3 pooling models against transformers: a Qwen3-Embedding-style model (the last token's hidden
state), a sequence classifier, and a Qwen3-Reranker-style yes/no reranker."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from kvforge import LLM
from tests.tiny_models import build_model, save_model, save_tokenizer

PROMPTS = [[5, 9, 13, 200, 7], [17], list(range(3, 70)), [101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111]]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-embedding")
    model = save_model(folder, "qwen3")
    with LLM(str(folder), runner="pooling", max_num_batched_tokens=80) as llm:
        yield llm, model


def test_last_token_embedding_matches_transformers(embedder):
    llm, model = embedder
    outputs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS])
    for prompt, output in zip(PROMPTS, outputs):
        with torch.no_grad():
            hidden = model.model(torch.tensor([prompt])).last_hidden_state[0, -1]
        ours = torch.tensor(output.outputs.embedding)
        assert torch.allclose(ours, F.normalize(hidden, dim=0), atol=1e-5)
    # Matryoshka dimensions, unnormalised
    (raw,) = llm.embed({"prompt_token_ids": PROMPTS[0]}, dimensions=16, normalize=False)
    with torch.no_grad():
        hidden = model.model(torch.tensor([PROMPTS[0]])).last_hidden_state[0, -1]
    assert torch.allclose(torch.tensor(raw.outputs.embedding), hidden[:16], atol=1e-4)


def test_sequence_classifier_matches_transformers(tmp_path):
    import transformers

    vocab_size = save_tokenizer(tmp_path)
    causal = build_model("qwen3", vocab_size=vocab_size)
    config = transformers.Qwen3Config(**{**causal.config.to_dict(), "num_labels": 3, "pad_token_id": 0})
    torch.manual_seed(1)
    model = transformers.Qwen3ForSequenceClassification(config).eval()
    model.save_pretrained(tmp_path)
    with LLM(str(tmp_path)) as llm:  # runner auto: the architecture only classifies
        outputs = llm.classify([{"prompt_token_ids": p} for p in PROMPTS])
    for prompt, output in zip(PROMPTS, outputs):
        with torch.no_grad():
            expected = model(torch.tensor([prompt])).logits[0].softmax(-1)
        assert torch.allclose(torch.tensor(output.outputs.probs), expected, atol=1e-5)


def test_yes_no_reranker_matches_transformers(tmp_path):
    model = save_model(tmp_path, "qwen3")
    config = json.loads((tmp_path / "config.json").read_text())
    no, yes = "Ġthe", "is"  # two tokens of the tiny vocabulary stand for "no" and "yes"
    config.update(architectures=["Qwen3ForSequenceClassification"], classifier_from_token=[no, yes])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with LLM(str(tmp_path)) as llm:
        tokenizer = llm.get_tokenizer()
        no_id, yes_id = tokenizer.token_id(no), tokenizer.token_id(yes)
        query, documents = "capital of France", ["Paris is the capital", "the lazy dog", "def add(a, b)"]
        outputs = llm.score(query, documents)
        for document, output in zip(documents, outputs):
            token_ids, _ = tokenizer.encode_pair(query, document)
            assert output.prompt_token_ids == token_ids
            with torch.no_grad():
                logits = model(torch.tensor([token_ids])).logits[0, -1]
            expected = logits[[no_id, yes_id]].softmax(-1)[1].item()  # P(yes) against P(no)
            assert output.outputs.score == pytest.approx(expected, abs=1e-5)
        with pytest.raises(ValueError, match="runner 'generate'"):
            llm.generate("hello")
