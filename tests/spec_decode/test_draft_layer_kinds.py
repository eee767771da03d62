"""Draft models and targets of sliding-window layers (Gemma 2) and of linear-attention layers (Qwen3.5): greedy tokens
are the target's alone, the target as its own draft has every draft accepted, every proposal of a draft that agrees
in part is what transformers' draft model continues greedily from the request's tokens (its keys, values and states
right after rejected drafts), and every block and state slot comes back."""

from __future__ import annotations

import copy

import pytest
import torch

from kvforge import LLM, SamplingParams
from tests.tiny_models import build_hybrid_model, build_model, save_tokenizer

# past Gemma 2's window of 12 tokens, two blocks of 16 and the max_num_batched_tokens of 24 (catch-up in chunks)
PROMPTS = [[5, 9, 17, 33, 5, 9, 17, 33, 40, 41] * 3, list(range(40, 52)) * 2 + [7, 8]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _noisy(model: torch.nn.Module, scale: float) -> torch.nn.Module:
    """A copy of model with noise on its weights: a draft that agrees with it in part."""
    noisy = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in noisy.parameters():
            weight.add_(scale * weight.std() * torch.randn(weight.shape, generator=generator))
    return noisy


@pytest.fixture(scope="module", params=["gemma2", "qwen3_5"])
def target_and_draft(request, tmp_path_factory):
    """(target folder, draft folder, transformers' draft model) of one architecture."""
    folders = [tmp_path_factory.mktemp(f"{request.param}-{name}") for name in ("target", "draft")]
    vocab_size = save_tokenizer(folders[0])
    save_tokenizer(folders[1])
    if request.param == "qwen3_5":
        target = build_hybrid_model("qwen3_5", vocab_size)
    else:
        target = build_model(request.param, vocab_size=vocab_size)
    draft = _noisy(target, 0.15)
    target.save_pretrained(folders[0])
    draft.save_pretrained(folders[1])
    return str(folders[0]), str(folders[1]), draft


def _hf_drafts(model: torch.nn.Module, token_ids: list[int], num_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([token_ids]), max_new_tokens=num_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(token_ids) :].tolist()


OPTIONS = dict(kv_cache_memory="4MiB", kv_cache_dtype="float32", enforce_eager=True, max_num_batched_tokens=24,
               max_num_seqs=2)


def _generate(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)]


@pytest.fixture(scope="module")
def expected(target_and_draft) -> list[list[int]]:
    """The target's greedy tokens without speculation."""
    reference = LLM(target_and_draft[0], **OPTIONS)
    try:
        return _generate(reference)
    finally:
        reference.shutdown()


def test_the_target_as_its_own_draft_has_every_draft_accepted(target_and_draft, expected):
    target = target_and_draft[0]
    llm = LLM(target, speculative_method="draft", speculative_model=target, num_speculative_tokens=3,
              speculative_adaptive=False, **OPTIONS)
    assert _generate(llm) == expected
    stats, cache = llm.engine.stats().spec_decode, llm.engine.cache_stats()
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate == 1.0
    assert cache.num_free_blocks == cache.num_usable_blocks


def test_a_hybrid_drafts_preempted_requests_start_their_states_anew(target_and_draft, expected):
    """In a cache of 4 blocks requests are preempted: their draft's state slots go back (4 requests pass through the
    2 slot pairs of max_num_seqs=2), and a recomputed request's draft state starts from its first token again (every
    draft of the target as its own draft still accepted)."""
    target = target_and_draft[0]
    if "qwen3_5" not in target:
        pytest.skip("the hybrid model's case")
    llm = LLM(target, speculative_method="draft", speculative_model=target, num_speculative_tokens=3,
              speculative_adaptive=False, **{**OPTIONS, "kv_cache_memory": "40KiB"})
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS * 2], PARAMS)  # 4 requests, 2 slot pairs
    assert [o.outputs[0].token_ids for o in outputs] == expected * 2
    stats, cache = llm.engine.stats(), llm.engine.cache_stats()
    assert stats.num_preemptions > 0 and stats.spec_decode.acceptance_rate == 1.0
    assert cache.num_free_blocks == cache.num_usable_blocks == 4


@pytest.mark.slow
def test_drafts_of_windowed_and_hybrid_models_are_transformers_greedy(target_and_draft, expected):
    target, draft_folder, draft = target_and_draft
    llm = LLM(target, speculative_method="draft", speculative_model=draft_folder, num_speculative_tokens=3,
              speculative_adaptive=False, **OPTIONS)
    engine, runner = llm.engine, llm.engine.runner
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, PARAMS)
    outputs, num_checked = {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output.outputs[0].token_ids
        for request_id, proposal in runner.draft.proposals.items():
            token_ids = runner.requests.token_list(request_id)
            if len(token_ids) == proposal.num_tokens:  # proposed after this step
                assert proposal.token_ids == _hf_drafts(draft, token_ids, len(proposal.token_ids))
                num_checked += 1
    assert [outputs[str(i)] for i in range(len(PROMPTS))] == expected
    stats = engine.stats().spec_decode
    assert num_checked > 0 and 0 < stats.acceptance_rate < 1
    cache = engine.cache_stats()
    assert cache.num_free_blocks == cache.num_usable_blocks
