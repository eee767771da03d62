"""A draft model with the target's tokenizer, run by kvforge's model runner: greedy outputs are the
target's; the target as its own draft has every draft accepted; a draft of another vocabulary is refused."""

from __future__ import annotations

import pytest

from kvforge import LLM, SamplingParams
from tests.tiny_models import save_model

PROMPTS = [{"prompt_token_ids": [5, 9, 17, 33, 5, 9, 17]}, {"prompt_token_ids": list(range(40, 70))}]


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    return _greedy(LLM(str(tiny_llama_dir[0]), kv_cache_memory="16MiB", enforce_eager=True))


def test_a_different_draft_model_keeps_the_target_greedy_tokens(tiny_llama_dir, reference, tmp_path):
    save_model(tmp_path, "llama", num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    llm = LLM(str(tiny_llama_dir[0]), kv_cache_memory="16MiB", enforce_eager=True, speculative_method="draft",
              speculative_model=str(tmp_path), num_speculative_tokens=3)
    assert _greedy(llm) == reference
    stats = llm.engine.stats().spec_decode
    assert stats.num_draft_tokens > 0
    cache = llm.engine.cache_stats()
    assert cache.num_free_blocks == cache.num_usable_blocks
    runner = llm.engine.runner
    assert runner.draft is not None
    llm.shutdown()
    assert runner.draft is None  # the draft model and its cache went with the target's


def test_the_target_as_its_own_draft_has_every_draft_accepted(tiny_llama_dir, reference):
    folder = str(tiny_llama_dir[0])
    llm = LLM(folder, kv_cache_memory="16MiB", enforce_eager=True, speculative_method="draft",
              speculative_model=folder, num_speculative_tokens=3)
    assert _greedy(llm) == reference
    stats = llm.engine.stats().spec_decode
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate == 1.0


def test_a_long_prompt_catches_up_in_chunks_of_the_token_budget(tiny_llama_dir):
    """A prompt of 40 tokens under max_num_batched_tokens=16: the draft's catch-up forward runs in chunks of at most
    16 tokens, as the target's prefill does, and its keys and values are right (the target as its own draft has
    every draft accepted)."""
    folder = str(tiny_llama_dir[0])
    prompt = [{"prompt_token_ids": list(range(5, 45))}]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    options = dict(kv_cache_memory="16MiB", enforce_eager=True, max_num_batched_tokens=16)
    expected = LLM(folder, **options).generate(prompt, params)[0].outputs[0].token_ids
    llm = LLM(folder, speculative_method="draft", speculative_model=folder, num_speculative_tokens=3, **options)
    forward_tokens = []
    llm.engine.runner.draft.model.register_forward_pre_hook(lambda _, args: forward_tokens.append(args[0].shape[0]))
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == expected
    assert llm.engine.stats().spec_decode.acceptance_rate == 1.0
    assert max(forward_tokens) == 16 and sum(forward_tokens) >= 40


@pytest.mark.slow
def test_the_drafts_decode_steps_run_compiled(tiny_llama_dir, reference):
    """With compilation on, the draft's decode steps (one row per drafting request) replay its compiled graphs, and
    the target as its own draft still has every draft accepted."""
    folder = str(tiny_llama_dir[0])
    llm = LLM(folder, kv_cache_memory="16MiB", speculative_method="draft", speculative_model=folder,
              num_speculative_tokens=3, compile_buckets=(1, 2, 4, 8))
    draft = llm.engine.runner.draft
    draft.graphs.compile_ahead(2)
    assert draft.graphs.compiled_buckets == (1, 2)
    replays = []
    run = draft.graphs.run
    draft.graphs.run = lambda *args: replays.append(run(*args)) or replays[-1]
    assert _greedy(llm) == reference
    assert llm.engine.stats().spec_decode.acceptance_rate == 1.0
    assert any(logits is not None for logits in replays)


def test_a_draft_with_another_vocabulary_is_refused(tiny_llama_dir, tmp_path):
    from tests.tiny_models import build_model, save_tokenizer

    save_tokenizer(tmp_path)
    build_model("llama", vocab_size=300).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(tiny_llama_dir[0]), kv_cache_memory="16MiB", speculative_method="draft",
            speculative_model=str(tmp_path))


def test_preempted_and_aborted_requests_give_back_the_blocks_the_draft_shares(tiny_llama_dir, tmp_path):
    """The draft's keys and values live in the target's blocks: with a draft that agrees in part (the target with
    noise), a cache too small for four requests preempts some, greedy tokens stay the target's, and after the
    requests finish or are aborted every block is free again."""
    import copy

    import torch

    from tests.tiny_models import save_tokenizer

    folder, model = str(tiny_llama_dir[0]), tiny_llama_dir[1]
    prompts = [{"prompt_token_ids": [5 + i, 9, 17, 33, 5, 9, 17] + list(range(40, 60))} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids
                for o in LLM(folder, kv_cache_memory="16MiB", enforce_eager=True).generate(prompts, params)]
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in draft.parameters():
            weight.add_(0.15 * weight.std() * torch.randn(weight.shape, generator=generator))
    save_tokenizer(tmp_path)
    draft.save_pretrained(tmp_path)
    # 40 KiB: 19 blocks of 4 tokens of the target's and the draft's keys and values (512 bytes a token)
    llm = LLM(folder, kv_cache_memory="40KiB", enforce_eager=True, block_size=4, speculative_method="draft",
              speculative_model=str(tmp_path), num_speculative_tokens=3, speculative_adaptive=False)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    stats, cache = llm.engine.stats(), llm.engine.cache_stats()
    assert stats.num_preemptions > 0 and 0 < stats.spec_decode.acceptance_rate < 1
    assert cache.num_free_blocks == cache.num_usable_blocks == 19
    engine = llm.engine
    for i, prompt in enumerate(prompts[:2]):
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(4):
        engine.step()
    assert engine.stats().spec_decode.num_draft_tokens > stats.spec_decode.num_draft_tokens
    engine.abort_request(["r0", "r1"])
    cache = llm.engine.cache_stats()
    assert cache.num_free_blocks == cache.num_usable_blocks
