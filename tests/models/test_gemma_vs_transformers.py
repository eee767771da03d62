"""Tiny random Gemma 2 and Gemma 3 models: kvforge against transformers (float32), with prompts longer than the
sliding window, chunked prefill that splits windows, prefix-cache hits, preemption and 16 requests at once, the local
layers' KV cache groups keeping only their windows' blocks; and (slow) through the Triton kernels in the interpreter."""

from __future__ import annotations

import random

import pytest
import torch

from kvforge import LLM, SamplingParams
from tests.tiny_models import assert_logits_match, assert_matches_on_the_triton_kernels, save_model

NUM_NEW = 10
PROMPT_LENS = [3, 9, 30, 17, 41, 12, 26, 8, 35, 20, 5, 33, 14, 22, 40, 11]  # 16 requests, most past the window
# a cache too small for two long requests at once, where one still fits with steps of 7 tokens (Gemma 3's 7 window
# groups hold their window and a step each)
SMALL_CACHE = {"gemma2": "48KiB", "gemma3_text": "56KiB"}


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model = save_model(folder, request.param)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, model.config.vocab_size) for _ in range(n)] for n in PROMPT_LENS]
    prompts[14] = prompts[4][:28] + prompts[14][28:]  # a shared prefix for the prefix cache
    return folder, model, prompts


def _expected(model, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens."""
    return [model.generate(torch.tensor([p]), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, do_sample=False,
                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def _generate(llm: LLM, prompts: list[list[int]]):
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def test_logits_match_past_the_window(tiny):
    folder, model, prompts = tiny
    llm = LLM(str(folder), kv_cache_memory="4MiB", kv_cache_dtype="float32", block_size=4)
    assert_logits_match(llm, model, [prompts[4], prompts[2]])
    groups = llm.engine.kv_cache_manager.groups
    assert groups[0].__class__.__name__ == "FullAttentionGroup" and len(groups) > 1
    assert all(group.window == model.config.sliding_window for group in groups[1:])


def test_greedy_in_chunks_with_preemption(tiny):
    """Two requests in a cache too small for both, prefills in chunks of 7 (which split windows), block size 4."""
    folder, model, prompts = tiny
    chosen = [prompts[4], prompts[2]]
    llm = LLM(str(folder), kv_cache_memory=SMALL_CACHE[model.config.model_type], kv_cache_dtype="float32", block_size=4,
              max_num_batched_tokens=7)
    outputs = _generate(llm, chosen)
    assert [o.outputs[0].token_ids for o in outputs] == _expected(model, chosen)
    assert llm.engine.stats().num_preemptions > 0
    cache = llm.engine.cache_stats()
    assert cache.num_free_blocks == cache.num_usable_blocks


@pytest.mark.slow
def test_sixteen_requests_chunked_preempted_and_prefix_cached(tiny):
    """16 requests in a cache too small for them all, prefills in chunks of 7 (which split windows), block size 4:
    the tokens transformers gives, preemptions on the way, and every block back in the pool at the end."""
    folder, model, prompts = tiny
    expected = _expected(model, prompts)
    llm = LLM(str(folder), kv_cache_memory=SMALL_CACHE[model.config.model_type], kv_cache_dtype="float32", block_size=4,
              max_num_batched_tokens=7, max_num_seqs=16)
    outputs = _generate(llm, prompts)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.engine.stats().num_preemptions > 0
    cache = llm.engine.cache_stats()
    assert cache.num_free_blocks == cache.num_usable_blocks
    # in a cache with room to keep them: a prompt that shares 28 tokens with an earlier one reuses its blocks, those
    # of the sliding windows included (released as the earlier request moved on, still cached)
    roomy = LLM(str(folder), kv_cache_memory="4MiB", kv_cache_dtype="float32", block_size=4)
    first, second = (_generate(roomy, [prompts[i]])[0] for i in (4, 14))
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == [expected[4], expected[14]]
    assert second.num_cached_tokens == 28


@pytest.mark.slow
def test_greedy_with_ngram_speculation(tiny):
    """Repetitive prompts, so n-gram drafts are proposed and verified across window boundaries."""
    folder, model, prompts = tiny
    repeated = [(p[:5] * 8)[: 20 + 3 * i] for i, p in enumerate(prompts[:4])]
    expected = _expected(model, repeated)
    llm = LLM(str(folder), kv_cache_memory="4MiB", kv_cache_dtype="float32", block_size=4,
              speculative_method="ngram", num_speculative_tokens=3, speculative_adaptive=False,
              speculative_max_rows=4096)
    outputs = _generate(llm, repeated)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.engine.stats().spec_decode.num_verified_requests > 0


@pytest.mark.slow
def test_greedy_with_tensor_parallelism(tiny):
    """Two ranks, each with one of the two KV heads and half the query heads, every layer group on both."""
    folder, model, prompts = tiny
    chosen = [prompts[4], prompts[2]]
    llm = LLM(str(folder), kv_cache_memory="4MiB", kv_cache_dtype="float32", block_size=4, tensor_parallel_size=2)
    assert [o.outputs[0].token_ids for o in _generate(llm, chosen)] == _expected(model, chosen)


@pytest.mark.slow
def test_logits_and_greedy_on_the_triton_kernels(tiny):
    """The Triton kernels (interpreted on the CPU): the local layers' windows and Gemma 2's soft-capped scores in the
    prefill and decode attention kernels, a 30-token prompt past the window in chunks of 16 that split it: logits
    within 1e-4 of transformers' and its greedy tokens."""
    folder, model, prompts = tiny
    chosen = [prompts[2], prompts[1]]
    assert_matches_on_the_triton_kernels(folder, model, chosen, _expected(model, chosen))
