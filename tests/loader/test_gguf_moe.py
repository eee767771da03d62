"""GGUF files of the mixture-of-experts families people download most, as llama.cpp's own converter writes them:
Qwen3-MoE (qwen3moe), Qwen2-MoE (qwen2moe: a gated shared expert) and Mixtral (a llama file with stacked experts),
run by kvforge against transformers running the Hugging Face folder they were converted from (float32: logits
close, greedy tokens equal).

Each conversion is a subprocess of 15-25 s on a small CPU: Qwen3-MoE runs by default, the others are marked slow.
The converter is told the pre-tokenizer of the tiny byte-level BPE ("qwen2"; Mixtral's: "gpt-2", whose split the
tiny tokenizer uses); llama.cpp runs no dense layers in a Qwen2-MoE file, so the tiny one has none.
"""

from __future__ import annotations

import random

import pytest

from tests.loader.test_gguf_families import LLAMA_CPP, _generate, _greedy, _llm, convert
from tests.tiny_models import assert_logits_match, save_tokenizer

pytestmark = pytest.mark.skipif(LLAMA_CPP is None, reason="no llama.cpp checkout (set LLAMA_CPP_DIR)")
_PRE = {"qwen3_moe": "qwen2", "qwen2_moe": "qwen2", "mixtral": "gpt-2"}
_OVERRIDES = {"qwen2_moe": {"mlp_only_layers": []}}


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (30, 9, 21)]


@pytest.fixture(scope="module", params=["qwen3_moe", pytest.param("qwen2_moe", marks=pytest.mark.slow),
                                        pytest.param("mixtral", marks=pytest.mark.slow)])  # fmt: skip
def moe(request, tmp_path_factory):
    from tests.models.test_moe_vs_transformers import build_moe_model

    folder = tmp_path_factory.mktemp(request.param)
    model = build_moe_model(request.param, save_tokenizer(folder), **_OVERRIDES.get(request.param, {}))
    model.save_pretrained(folder)
    return model, convert(folder, "f32", _PRE[request.param])


def test_moe_gguf_matches_transformers(moe):
    """The router, the stacked experts (top-k renormalized or not), Qwen2-MoE's gated shared expert, Mixtral's
    llama-named file; prefill in chunks."""
    model, path = moe
    llm = _llm(path, max_num_batched_tokens=7)
    prompts = _prompts(model.config.vocab_size)
    assert_logits_match(llm, model, prompts[:2])
    assert _generate(llm, prompts) == _greedy(model, prompts)
