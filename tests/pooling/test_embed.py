"""all-MiniLM-L6-v2 through LLM.embed against sentence-transformers, batched step by step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvforge import LLM
from kvforge.kernels.cpu.bf16_gemm import bf16_matmuls_supported
from tests.pooling.conftest import SENTENCES

LONG_TEXT = "the engine pools hidden states into one vector " * 40  # > 256 tokens


@pytest.fixture(scope="module")
def llm(minilm_dir):
    # a budget of 48 tokens: the sentences run over several steps, short ones together, the long one alone
    with LLM(str(minilm_dir), max_num_batched_tokens=48) as llm:
        yield llm


def _vectors(outputs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outputs])


def test_embeddings_match_sentence_transformers(llm, minilm_reference):
    outputs = llm.embed(SENTENCES)
    assert [len(o.prompt_token_ids) for o in outputs] == [len(llm.get_tokenizer().encode(s)) for s in SENTENCES]
    ours = _vectors(outputs)
    assert ours.shape == minilm_reference.shape
    assert F.cosine_similarity(ours, minilm_reference).min().item() >= 0.9999
    assert torch.allclose(ours.norm(dim=1), torch.ones(len(SENTENCES)), atol=1e-5)  # the Normalize module


def test_bf16_matmuls_off_multiplies_in_float32(llm, minilm_dir, minilm_reference):
    """The default engine takes bfloat16 products where the CPU has AMX (the cosine bound above holds for it); an
    engine beside it with bf16_matmuls=False multiplies in float32, as sentence-transformers does."""
    with LLM(str(minilm_dir), max_num_batched_tokens=48, bf16_matmuls=False) as exact:
        off = _vectors(exact.embed(SENTENCES))
    assert F.cosine_similarity(off, minilm_reference).min().item() >= 0.999999
    if bf16_matmuls_supported():
        on = _vectors(llm.embed(SENTENCES))
        assert 1e-5 < (on - off).abs().max().item() < 0.01


def test_token_ids_dimensions_and_normalize(llm, minilm_reference):
    token_ids = llm.get_tokenizer().encode(SENTENCES[0])
    (by_ids,) = llm.embed({"prompt_token_ids": token_ids})
    assert F.cosine_similarity(_vectors([by_ids]), minilm_reference[:1]).item() >= 0.9999
    short = _vectors(llm.embed(SENTENCES[:3], dimensions=32))  # Matryoshka: the first 32 values, normalised
    assert short.shape == (3, 32)
    expected = F.normalize(minilm_reference[:3, :32], dim=1)
    assert F.cosine_similarity(short, expected).min().item() >= 0.9999
    assert torch.allclose(short.norm(dim=1), torch.ones(3), atol=1e-5)
    raw = _vectors(llm.embed(SENTENCES[:3], normalize=False))
    assert (raw.norm(dim=1) - 1).abs().min().item() > 0.1  # mean pooling alone is not of unit length


def test_inputs_past_the_window(llm, minilm_reference):
    with pytest.raises(ValueError, match="window is 256 tokens"):
        llm.embed(LONG_TEXT)
    with pytest.raises(ValueError, match="dimensions must be at most the model's 384"):
        llm.embed("x", dimensions=385)
    # refused inputs left nothing queued: the next call runs as usual
    (after,) = llm.embed(LONG_TEXT, truncate_prompt_tokens=256)
    assert len(after.prompt_token_ids) == 256 and len(after.outputs.embedding) == 384


def test_truncation_keeps_the_last_tokens(llm, minilm_dir):
    """truncate_prompt_tokens=k keeps an input's last k tokens (vLLM's rule; -1: the window's worth), embedded as
    sentence-transformers embeds those tokens."""
    from sentence_transformers import SentenceTransformer

    token_ids = llm.get_tokenizer().encode(LONG_TEXT)
    (cut,) = llm.embed(LONG_TEXT, truncate_prompt_tokens=100)
    assert cut.prompt_token_ids == token_ids[-100:]
    (window,) = llm.embed(LONG_TEXT, truncate_prompt_tokens=-1)
    assert window.prompt_token_ids == token_ids[-256:]
    model = SentenceTransformer(str(minilm_dir), device="cpu")
    kept = torch.tensor([token_ids[-100:]])
    with torch.no_grad():
        expected = model({"input_ids": kept, "attention_mask": torch.ones_like(kept)})["sentence_embedding"]
    assert F.cosine_similarity(_vectors([cut]), expected).item() >= 0.9999
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be an integer >= 1, or -1"):
        llm.embed(LONG_TEXT, truncate_prompt_tokens=0)


def test_score_is_cosine_similarity_and_generate_is_refused(llm, minilm_reference):
    scores = [o.outputs.score for o in llm.score(SENTENCES[0], SENTENCES[1:3])]
    ours = _vectors(llm.embed(SENTENCES[:3]))
    assert scores == pytest.approx(F.cosine_similarity(ours[:1], ours[1:3]).tolist(), abs=1e-6)
    # NOTE: bfloat16 products (the default where the CPU has AMX) move a cosine between two texts by up to ~1.5e-3
    # (512 benchmark sentences); float32 matmuls by under 1e-6
    expected = F.cosine_similarity(minilm_reference[:1], minilm_reference[1:3]).tolist()
    assert scores == pytest.approx(expected, abs=2e-3)
    with pytest.raises(ValueError, match="runner 'generate'"):
        llm.generate("hello")
    with pytest.raises(ValueError, match="no classifier head"):
        llm.classify("hello")
