"""Greedy decoding with every proposer gives transformers' greedy tokens, token for token, on tiny random
models of four families: 16 requests at once under chunked prefill and forced preemption, then one request
alone with a prefix-cache hit; no block leaks."""

from __future__ import annotations

import random

import pytest
import torch

from kvforge import LLM, SamplingParams
from tests.models.test_moe_vs_transformers import build_moe_model
from tests.tiny_models import build_model, save_tokenizer

NUM_NEW = 24
METHODS = ["ngram", "suffix"]


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """NOTE: tiny models gain nothing from a second thread (see tests/models/test_moe_vs_transformers.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _prompts(vocab_size: int) -> list[list[int]]:
    """16 prompts that repeat part of themselves (so drafts get accepted), two sharing a prefix."""
    rng = random.Random(0)
    prompts = []
    for n in [5, 17, 33, 9, 40, 12, 24, 3, 30, 7, 21, 14, 36, 11, 26, 19]:
        base = [rng.randrange(3, vocab_size) for _ in range(n)]
        prompts.append(base + base[: n // 2])
    prompts[6] = prompts[4][:40]
    return prompts


@pytest.fixture(scope="module", params=["llama", "qwen3", "mixtral", "deepseek_v3"])
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    vocab_size = save_tokenizer(folder)
    if request.param in ("llama", "qwen3"):
        model = build_model(request.param, vocab_size=vocab_size)
    else:
        model = build_moe_model(request.param, vocab_size)
    model.save_pretrained(folder)
    prompts = _prompts(vocab_size)
    expected = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW,
                             do_sample=False, pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    return folder, prompts, expected


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, min_tokens=NUM_NEW)  # as min_new_tokens
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _kv_bytes_for(llm_probe: LLM, num_blocks: int) -> int:
    return llm_probe.engine.kv_cache_bytes() // llm_probe.engine.executor.num_blocks * num_blocks


@pytest.mark.parametrize("method", METHODS)
def test_greedy_tokens_match_transformers(tiny, method):
    folder, prompts, expected = tiny
    probe = LLM(str(folder), kv_cache_memory="1MiB", enforce_eager=True)
    llm = LLM(str(folder), kv_cache_memory=_kv_bytes_for(probe, 24), enforce_eager=True,  # 23 usable blocks
              max_num_batched_tokens=48, speculative_method=method, speculative_max_rows=256,
              speculative_adaptive=False)
    assert _generate(llm, prompts) == expected
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_decode.num_accepted_tokens > 0
    assert _generate(llm, prompts[4:5]) == expected[4:5]
    assert llm.engine.stats().num_prefix_hit_tokens > 0
    cache = llm.engine.cache_stats()
    assert cache.num_free_blocks == cache.num_usable_blocks
