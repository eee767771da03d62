"""The default model (SmolLM2-135M-Instruct, its Q4_1 GGUF weights kept) gives the same greedy tokens with
prompt lookup as without it, on prompts that repeat text (so drafts are accepted)."""

from __future__ import annotations

from kvforge import LLM, SamplingParams

PROMPTS = [
    "The quick brown fox jumps over the lazy dog near the river bank.\n"
    "The quick brown fox jumps over the lazy dog near the river bank.\n",
    "Monday, Tuesday, Wednesday, Thursday, Friday.\nMonday, Tuesday, Wednesday, Thursday, Friday.\nMonday,",
]


def test_greedy_tokens_with_prompt_lookup_are_those_without():
    # every decoding request drafts 4 tokens (not only where the policy expects a gain): the most verification
    llm = LLM(quantization="gguf", kv_cache_memory="64MiB", enforce_eager=True, speculative_method="ngram",
              speculative_adaptive=False)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with_lookup = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    stats = llm.engine.stats().spec_decode
    assert stats.num_accepted_tokens >= 12 and stats.mean_accepted_length > 2.0
    # NOTE: the same engine with its scheduler's speculation detached decodes as an engine without it does
    # (one load of the model instead of two)
    llm.engine.scheduler.speculation = None
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == with_lookup
    cache = llm.engine.cache_stats()
    assert cache.num_free_blocks == cache.num_usable_blocks
