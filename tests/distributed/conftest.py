"""Tiny random checkpoints for the multi-process tests (4 layers, 4 query heads, 2 KV heads)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvforge import LLM, SamplingParams

PROMPTS = ["The quick brown fox", "Paris is the capital", "def add(a, b):", "Large language models"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SCORED_TOKENS = list(range(5, 45))
WITH_LOGPROBS = SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, prompt_logprobs=2)


def logprob_values(llm: LLM) -> list[float]:
    """The sampled and prompt logprobs (top 2 of each position) of PROMPTS[0], flattened."""
    out = llm.generate(PROMPTS[:1], WITH_LOGPROBS)[0]
    positions = [p for p in out.prompt_logprobs if p] + out.outputs[0].logprobs
    return [entry.logprob for position in positions for _, entry in sorted(position.items())]


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def parallel_model(request, tmp_path_factory) -> tuple[Path, list[list[int]], object, list[float]]:
    """(folder, and from one process: greedy tokens of PROMPTS, logits of SCORED_TOKENS, logprobs)."""
    from tests.tiny_models import save_model

    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    save_model(folder, request.param, num_hidden_layers=4)
    llm = LLM(str(folder), kv_cache_memory="16MiB")
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    return folder, tokens, llm.engine.score(SCORED_TOKENS), logprob_values(llm)
