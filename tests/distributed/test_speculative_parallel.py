"""Speculation under tensor and pipeline parallelism (Gloo, one process per rank): greedy tokens as in one
process without speculation, and every block free afterwards."""

from __future__ import annotations

import pytest

from kvforge import LLM, SamplingParams

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox", "def add(a, b):\n    return a + b"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _tokens(folder: str, **engine_kwargs) -> tuple[list[list[int]], int]:
    llm = LLM(folder, kv_cache_memory="16MiB", enforce_eager=True, **engine_kwargs)
    try:
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        cache = llm.engine.cache_stats()
        assert cache.num_free_blocks == cache.num_usable_blocks
        return tokens, llm.engine.stats().spec_decode.num_accepted_tokens
    finally:
        llm.shutdown()


@pytest.mark.parametrize("method", ["ngram", pytest.param("draft", marks=pytest.mark.slow)])
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_speculation_under_parallelism_keeps_the_greedy_tokens(tiny_llama_dir, tp: int, pp: int, method: str) -> None:
    """The draft model (the target itself) runs whole on the sampling rank, its keys and values in that rank's
    blocks."""
    folder = str(tiny_llama_dir[0])
    want, _ = _tokens(folder)
    draft = {"speculative_model": folder} if method == "draft" else {}
    got, num_accepted = _tokens(folder, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                speculative_method=method, speculative_adaptive=False, **draft)
    assert got == want and num_accepted > 0
