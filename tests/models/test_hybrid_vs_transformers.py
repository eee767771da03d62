"""Tiny random hybrid models (Gated DeltaNet + gated attention): Qwen3-Next, Qwen3.5 dense and Qwen3.5 MoE, kvforge
against transformers in float32: logits, greedy tokens across several 64-token chunks of the delta rule, chunked
prefill, preemption, prefix-cache hits from kept states, and the state slots given back."""

from __future__ import annotations

import random

import pytest
import torch

from kvforge import LLM, SamplingParams
from tests.tiny_models import HYBRID_ARCHS, HYBRID_COMMON, assert_logits_match, build_hybrid_model, save_tokenizer

NUM_NEW = 8
PROMPT_LENS = [5, 70, 150, 1, 33]  # 70 and 150 span two and three chunks of the chunked delta rule
@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """NOTE: tiny models gain nothing from a second thread on 2 shared cores (as in test_moe_vs_transformers)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=list(HYBRID_ARCHS))
def tiny_hybrid(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model = build_hybrid_model(request.param, save_tokenizer(folder))
    model.save_pretrained(folder)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, model.config.vocab_size) for _ in range(n)] for n in PROMPT_LENS]
    expected = [model.generate(torch.tensor([p]), max_new_tokens=NUM_NEW, do_sample=False, pad_token_id=0)[0, len(p) :]
                .tolist() for p in prompts]  # fmt: skip
    return folder, model, prompts, expected


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int = NUM_NEW):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def _assert_all_given_back(llm: LLM) -> None:
    cache = llm.engine.cache_stats()
    assert cache.num_free_blocks == cache.num_usable_blocks
    assert llm.engine.kv_cache_manager.groups[-1].num_used_slots == 0


def test_logits_greedy_and_prefix_hits(tiny_hybrid):
    """Then prefix-cache hits: the prompts again start from the states kept at their last block boundaries (blocks of
    16); two prompts sharing 100 tokens with the 150-token one: the first keeps the state after the 96 tokens of
    shared blocks, the second starts from a copy of it. Every time transformers' tokens."""
    folder, model, prompts, expected = tiny_hybrid
    llm = LLM(str(folder), kv_cache_memory="16MiB", kv_cache_dtype="float32")
    assert_logits_match(llm, model, prompts[:3])
    assert [o.outputs[0].token_ids for o in _generate(llm, prompts)] == expected
    again = _generate(llm, prompts)
    assert [o.outputs[0].token_ids for o in again] == expected
    assert [o.num_cached_tokens for o in again] == [0, 64, 144, 0, 32]
    rng = random.Random(1)
    sharing = [prompts[2][:100] + [rng.randrange(3, model.config.vocab_size) for _ in range(12)] for _ in range(2)]
    outputs = [_generate(llm, [prompt])[0] for prompt in sharing]  # one after the other
    assert [o.outputs[0].token_ids for o in outputs] == [
        model.generate(torch.tensor([p]), max_new_tokens=NUM_NEW, do_sample=False, pad_token_id=0)[0, len(p) :]
        .tolist() for p in sharing]  # fmt: skip
    assert [o.num_cached_tokens for o in outputs] == [0, 96]
    assert llm.engine.cache_stats().num_prefix_hit_tokens == 64 + 144 + 32 + 96
    _assert_all_given_back(llm)


def test_chunked_prefill_preemption_and_16_requests(tiny_hybrid):
    """Chunks of 24 tokens carry the conv and delta states from chunk to chunk; 16 requests in a cache of 20 blocks
    (of 16 tokens of 128 bytes: one full-attention layer's keys and values, float16) preempt each other, recompute,
    and still decode what transformers does."""
    folder, _, prompts, expected = tiny_hybrid
    llm = LLM(str(folder), kv_cache_memory=20 * 16 * 128, max_num_batched_tokens=24, max_num_seqs=16)
    assert llm.engine.cache_stats().num_usable_blocks == 19
    outputs = _generate(llm, prompts * 3 + prompts[:1])
    assert [o.outputs[0].token_ids for o in outputs] == (expected * 3 + expected[:1])
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_all_given_back(llm)


@pytest.mark.slow
def test_qwen3_5_on_the_triton_kernels(tmp_path):
    """Qwen3.5 through the Triton kernels (interpreted on the CPU): the conv1d and the chunked delta rule over a
    prompt of two chunks, then the decode step."""
    model = build_hybrid_model("qwen3_5", save_tokenizer(tmp_path))
    model.save_pretrained(tmp_path)
    prompts = [[5, 9, 300, 41, 7], list(range(3, 73))]
    expected = [model.generate(torch.tensor([p]), max_new_tokens=3, do_sample=False, pad_token_id=0)[0, len(p) :]
                .tolist() for p in prompts]  # fmt: skip
    llm = LLM(str(tmp_path), kv_cache_memory="4MiB", attention_backend="triton")
    assert [o.outputs[0].token_ids for o in _generate(llm, prompts, max_tokens=3)] == expected


def test_qwen3_5_multimodal_checkpoint_runs_its_text_model(tmp_path):
    """A Qwen3_5ForConditionalGeneration checkpoint (as Qwen3.5 ships: model.language_model.*, model.visual.*, the
    text config nested): kvforge runs its text model and decodes text prompts as transformers does."""
    import transformers

    text = dict(HYBRID_COMMON, vocab_size=save_tokenizer(tmp_path))
    config = transformers.Qwen3_5Config(text_config=text, vision_config=dict(
        depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64))
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path)
    model.generation_config.eos_token_id = None
    prompts = [[5, 9, 300, 41, 7], list(range(3, 40))]
    expected = [model.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False, pad_token_id=0)[0, len(p) :]
                .tolist() for p in prompts]  # fmt: skip
    llm = LLM(str(tmp_path), kv_cache_memory="4MiB", kv_cache_dtype="float32")
    assert [o.outputs[0].token_ids for o in _generate(llm, prompts, max_tokens=4)] == expected


def test_speculative_decoding_keeps_the_states_of_accepted_drafts(tiny_hybrid):
    """n-gram drafts verified a position at a time through the linear layers: the state after the accepted drafts is
    the one the next step continues from, so the tokens are transformers' while some drafts are accepted and some
    rejected."""
    folder, model, prompts, _ = tiny_hybrid
    prompts = [p[:12] * 3 for p in prompts[1:4]]  # repeated text: the n-gram proposer finds drafts
    expected = [model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, pad_token_id=0)[0, len(p) :]
                .tolist() for p in prompts]  # fmt: skip
    # NOTE: one-token n-grams draft wherever a token recurs: many drafts, of which some are rejected
    llm = LLM(str(folder), kv_cache_memory="4MiB", kv_cache_dtype="float32", speculative_method="ngram",
              num_speculative_tokens=3, speculative_adaptive=False, prompt_lookup_min=1)
    assert [o.outputs[0].token_ids for o in _generate(llm, prompts, max_tokens=24)] == expected
    stats = llm.engine.scheduler.stats().spec_decode
    assert 0 < sum(stats.num_accepted_per_position) < stats.num_draft_tokens
    _assert_all_given_back(llm)


@pytest.mark.slow
def test_tensor_parallel_2(tiny_hybrid):
    """Two ranks (Gloo, one process each): each holds half the attention heads, half the linear-attention key heads
    with their value heads (their conv channels, A_log and dt_bias) and its states; the logits and tokens are
    transformers'."""
    folder, model, prompts, expected = tiny_hybrid
    llm = LLM(str(folder), kv_cache_memory="16MiB", kv_cache_dtype="float32", tensor_parallel_size=2)
    try:
        assert len(llm.engine.executor.processes) == 1  # rank 1's process beside this one
        assert llm.engine.local_model.layers[0].self_attn.A_log.shape == (2,)  # half of the 4 value heads
        assert_logits_match(llm, model, prompts[1:3])
        assert [o.outputs[0].token_ids for o in _generate(llm, prompts)] == expected
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_pipeline_parallel_2(tmp_path):
    """Two stages (Gloo, one process each) of a Qwen3.5 whose layers alternate linear and full attention, so that each
    stage has both kinds: each keeps its own layers' KV cache, state slots and kept states. Transformers' tokens, and
    the same again from prefix-cache hits."""
    model = build_hybrid_model("qwen3_5", save_tokenizer(tmp_path),
                               layer_types=["linear_attention", "full_attention"] * 2)
    model.save_pretrained(tmp_path)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, model.config.vocab_size) for _ in range(n)] for n in PROMPT_LENS]
    expected = [model.generate(torch.tensor([p]), max_new_tokens=NUM_NEW, do_sample=False, pad_token_id=0)[0, len(p) :]
                .tolist() for p in prompts]  # fmt: skip
    llm = LLM(str(tmp_path), kv_cache_memory="16MiB", kv_cache_dtype="float32", pipeline_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in _generate(llm, prompts)] == expected
        again = _generate(llm, prompts)
        assert [o.outputs[0].token_ids for o in again] == expected
        assert [o.num_cached_tokens for o in again] == [0, 64, 144, 0, 32]
    finally:
        llm.shutdown()
    # the fixtures' layers (linear, full, linear, linear) leave the second stage no full-attention layer
    uneven = tmp_path / "uneven"
    build_hybrid_model("qwen3_5", save_tokenizer(uneven)).save_pretrained(uneven)
    with pytest.raises(ValueError, match="gives layers 2..3 of Qwen3_5ForCausalLM no full-attention layer"):
        LLM(str(uneven), kv_cache_memory="4MiB", pipeline_parallel_size=2)
