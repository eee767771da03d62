"""A tiny random GPT-OSS: kvforge against transformers (float32), with prompts longer than the sliding window, chunked
prefill that splits windows, prefix-cache hits, preemption, speculative decoding, 16 requests at once and tensor
parallelism 2 (those four slow); and the same model with its experts in MXFP4 (quantized here by the format's
definition, kept in MXFP4 by kvforge) against transformers running the weights that transformers' own MXFP4
dequantizer makes of the checkpoint's blocks and scales, also (slow) through the Triton kernels in the interpreter."""

from __future__ import annotations

import random

import pytest
import torch

from kvforge import LLM, SamplingParams
from tests.tiny_models import assert_logits_match, assert_matches_on_the_triton_kernels, save_model, save_mxfp4_experts

NUM_NEW = 10
PROMPT_LENS = [3, 9, 30, 17, 41, 12, 26, 8, 35, 20, 5, 33, 14, 22, 40, 11]  # 16 requests, most past the window


def _greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    return [model.generate(torch.tensor([p]), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, do_sample=False,
                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]  # fmt: skip


def _generate(llm: LLM, prompts: list[list[int]]) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt_oss")
    model = save_model(folder, "gpt_oss")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, model.config.vocab_size) for _ in range(n)] for n in PROMPT_LENS]
    prompts[14] = prompts[4][:28] + prompts[14][28:]  # a shared prefix for the prefix cache
    return folder, model, prompts


def test_logits_match_past_the_window(tiny):
    folder, model, prompts = tiny
    llm = LLM(str(folder), kv_cache_memory="4MiB", kv_cache_dtype="float32", block_size=4)
    assert_logits_match(llm, model, [prompts[4], prompts[2]])
    groups = llm.engine.kv_cache_manager.groups
    assert len(groups) == 2 and groups[1].window == model.config.sliding_window


def _check_chunked_and_prefix_cached(folder, model, prompts: list[list[int]]) -> None:
    """prompts at once, prefills in chunks of 7 (which split windows), block size 4: the tokens transformers gives,
    every block back in the pool at the end, then the first two again: the second shares its first 28 tokens with
    the first, a prefix-cache hit, and the same tokens."""
    expected = _greedy(model, prompts)
    llm = LLM(str(folder), kv_cache_memory="4MiB", kv_cache_dtype="float32", block_size=4,
              max_num_batched_tokens=7, max_num_seqs=16, enforce_eager=True)  # fmt: skip
    outputs = _generate(llm, prompts)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    cache = llm.engine.cache_stats()
    assert cache.num_free_blocks == cache.num_usable_blocks
    again = _generate(llm, prompts[:2])
    assert [o.outputs[0].token_ids for o in again] == expected[:2]
    assert again[1].num_cached_tokens > 0


def test_greedy_chunked_and_prefix_cached(tiny):
    folder, model, prompts = tiny
    _check_chunked_and_prefix_cached(folder, model, [prompts[4], prompts[14], prompts[2]])


@pytest.mark.slow
def test_greedy_16_requests(tiny):
    folder, model, prompts = tiny
    _check_chunked_and_prefix_cached(
        folder, model, [prompts[4], prompts[14]] + prompts[:4] + prompts[5:14] + prompts[15:]
    )


@pytest.mark.slow
def test_greedy_with_preemption(tiny):
    """Two requests in a cache too small for both (24 blocks of 4 tokens: a request past 40 tokens holds 13 full and
    4 window blocks), prefills in chunks of 7 (which split windows): one is preempted, recomputed, and both decode
    what transformers does; every block back in the pool."""
    folder, model, prompts = tiny
    chosen = [prompts[4], prompts[2]]
    llm = LLM(str(folder), kv_cache_memory="48KiB", kv_cache_dtype="float32", block_size=4, max_num_batched_tokens=7,
              enforce_eager=True)  # fmt: skip
    assert llm.engine.cache_stats().num_usable_blocks == 23
    assert [o.outputs[0].token_ids for o in _generate(llm, chosen)] == _greedy(model, chosen)
    assert llm.engine.stats().num_preemptions > 0
    cache = llm.engine.cache_stats()
    assert cache.num_free_blocks == cache.num_usable_blocks


@pytest.mark.slow
def test_greedy_with_ngram_speculation(tiny):
    """Prompts past the window in which the token the model goes on to repeat is followed by others: the n-gram
    proposer drafts those (rejected, their KV slots rolled back) and the repeats (accepted), verified across window
    boundaries; transformers' tokens, and their logprobs as transformers' log-softmax."""
    folder, model, prompts = tiny
    first = _greedy(model, prompts[1:2])[0][0]
    chosen = [p[:9] + [first, 7, 8, 9] + p[:9] for p in prompts[1:5]]
    # NOTE: no min_new_tokens, whose processor would take EOS out of the scores' softmax
    expected = [model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, pad_token_id=0,
                               output_scores=True, return_dict_in_generate=True) for p in chosen]  # fmt: skip
    llm = LLM(str(folder), kv_cache_memory="4MiB", kv_cache_dtype="float32", block_size=4, enforce_eager=True,
              speculative_method="ngram", num_speculative_tokens=3, speculative_adaptive=False, prompt_lookup_min=1,
              speculative_max_rows=64)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in chosen], params)
    for output, prompt, reference in zip(outputs, chosen, expected):
        tokens = output.outputs[0].token_ids
        assert tokens == reference.sequences[0, len(prompt) :].tolist() and len(tokens) == 16
        theirs = [torch.log_softmax(scores[0].float(), -1)[token].item() for scores, token in zip(reference.scores,
                                                                                                     tokens)]
        ours = [position[token].logprob for position, token in zip(output.outputs[0].logprobs, tokens)]
        assert ours == pytest.approx(theirs, abs=1e-4)
    stats = llm.engine.stats().spec_decode
    assert 0 < sum(stats.num_accepted_per_position) < stats.num_draft_tokens
    cache = llm.engine.cache_stats()
    assert cache.num_free_blocks == cache.num_usable_blocks


def test_mxfp4_experts_match_their_dequantized_weights(tiny, tmp_path):
    """The experts stay MXFP4 codes and scales in kvforge (no float copy); logits and greedy tokens as transformers
    running the dequantized weights."""
    folder, model, prompts = tiny
    reference = save_mxfp4_experts(tmp_path, folder, model)
    llm = LLM(str(tmp_path), kv_cache_memory="4MiB", kv_cache_dtype="float32", block_size=4, enforce_eager=True)
    experts = llm.engine.runner.model.layers[0].mlp.experts
    assert experts.gate_up_proj_blocks.dtype == torch.uint8 and not hasattr(experts, "gate_up_proj")
    assert_logits_match(llm, reference, [prompts[4]])
    outputs = _generate(llm, prompts[2:4])
    assert [o.outputs[0].token_ids for o in outputs] == _greedy(reference, prompts[2:4])


@pytest.mark.slow
@pytest.mark.parametrize("experts", ["float", "mxfp4"])
def test_tensor_parallel_2(tiny, tmp_path, experts):
    """Two ranks: each holds half the heads (and their sinks) and half of every expert's intermediate dim (one MXFP4
    block of 32 a row here); the same tokens and logits as transformers."""
    folder, model, prompts = tiny
    if experts == "mxfp4":
        model, folder = save_mxfp4_experts(tmp_path, folder, model), tmp_path
    expected = _greedy(model, prompts[:4])
    llm = LLM(str(folder), kv_cache_memory="4MiB", kv_cache_dtype="float32", block_size=4, tensor_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in _generate(llm, prompts[:4])] == expected[:4]
        assert_logits_match(llm, model, [prompts[4]])
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_mxfp4_experts_on_the_triton_kernels(tiny, tmp_path):
    """The MXFP4 checkpoint through the Triton kernels (interpreted on the CPU): the sinks and the window in the
    prefill and decode attention kernels (a 30-token prompt past the window of 8, in chunks of 16 that split it), the
    MXFP4 MoE kernel; logits within 1e-4 of transformers' running the dequantized weights, and its greedy tokens."""
    folder, model, prompts = tiny
    reference = save_mxfp4_experts(tmp_path, folder, model)
    chosen = [prompts[2], prompts[1]]
    assert_matches_on_the_triton_kernels(tmp_path, reference, chosen, _greedy(reference, chosen))
