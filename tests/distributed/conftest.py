"""Tiny random checkpoints for the multi-process tests (4 layers, 4 query heads, 2 KV heads)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvforge import LLM, SamplingParams

PROMPTS = ["The quick brown fox", "Paris is the capital", "def add(a, b):", "Large language models"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SCORED_TOKENS = list(range(5, 45))


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def parallel_model(request, tmp_path_factory) -> tuple[Path, list[list[int]], object]:
    """(folder, single-process greedy tokens of PROMPTS, single-process logits of SCORED_TOKENS)."""
    from tests.tiny_models import save_model

    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    save_model(folder, request.param, num_hidden_layers=4)
    llm = LLM(str(folder), kv_cache_memory="16MiB")
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    return folder, tokens, llm.engine.score(SCORED_TOKENS)
