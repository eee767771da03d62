"""Tiny random models of each architecture: kvforge against transformers, logits and greedy tokens."""

from __future__ import annotations

import random

import pytest
import torch

from kvforge import LLM, SamplingParams
from tests.tiny_models import assert_logits_match, save_model

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
NUM_NEW = 32
PROMPT_LENS = [5, 17, 33, 1, 64, 12, 40, 3]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model = save_model(folder, request.param)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]
    # Two prompts share a 40-token prefix so prefix caching has something to hit.
    prompts[6] = prompts[4][:40]
    expected = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW,
                             do_sample=False, pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    return folder, model, prompts, expected


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outputs]


def test_logits_match(tiny):
    folder, model, prompts, _ = tiny
    # a float32 cache: the math against transformers' (the CPU's default float16 cache: test_kv_cache_dtype.py)
    llm = LLM(str(folder), kv_cache_memory="16MiB", kv_cache_dtype="float32")
    assert_logits_match(llm, model, prompts[:3] + prompts[4:5])
    # every layer reads the model's one cos/sin table (not a table per layer)
    tables = [name for name, _ in llm.engine.local_model.named_buffers() if name.endswith("cos_sin_cache")]
    assert tables == ["rotary.cos_sin_cache"]


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {},
        {"max_num_batched_tokens": 7},
        {"long_prefill_token_threshold": 5, "enable_prefix_caching": False},
        {"block_size": 32, "enable_prefix_caching": False},
    ],
    ids=["default", "chunked-7", "chunked-5-no-prefix-cache", "block-32"],
)
def test_greedy_batch_matches(tiny, engine_kwargs):
    folder, _, prompts, expected = tiny
    llm = LLM(str(folder), kv_cache_memory="16MiB", **engine_kwargs)
    assert _generate(llm, prompts) == expected
    cache = llm.engine.cache_stats()
    assert cache.num_free_blocks == cache.num_usable_blocks


def test_prefix_cache_hits_and_same_output(tiny):
    folder, _, prompts, expected = tiny
    llm = LLM(str(folder), kv_cache_memory="16MiB")
    assert _generate(llm, prompts) == expected
    # Run again: every prompt's full leading blocks are now cached.
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert outputs[4].num_cached_tokens == 48  # 64-token prompt, 16-token blocks, last token recomputed
    assert outputs[0].num_cached_tokens == 0  # 5 tokens: no full block


def test_preemption_keeps_output(tiny):
    folder, model, prompts, expected = tiny
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    block_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4 * 16
    llm = LLM(str(folder), kv_cache_memory=block_bytes * 12)  # 11 usable blocks: 176 tokens for 431
    assert _generate(llm, prompts) == expected
    assert llm.engine.stats().num_preemptions > 0
    cache = llm.engine.cache_stats()
    assert cache.num_free_blocks == cache.num_usable_blocks
