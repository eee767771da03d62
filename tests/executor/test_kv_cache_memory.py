"""The KV cache sized to need: by default what max_num_seqs sequences of max_model_len tokens fill, within the
budget and the memory free, with the limit that chose it in the log; as asked when kv_cache_memory is given."""

from __future__ import annotations

import logging

import pytest

from kvforge import LLM, SamplingParams
from kvforge.executor import kv_cache_memory
from kvforge.executor.kv_cache_memory import size_kv_cache
from kvforge.loader.memory_fit import WORKING_SET, available_memory
from tests.tiny_models import build_hybrid_model, save_tokenizer

MiB, GiB = 2**20, 2**30
LIMITS = [("the budget", 2 * GiB), ("the memory free", 20 * GiB)]


def test_a_cache_holds_what_its_sequences_need_within_every_limit() -> None:
    # 4 sequences of 100 tokens: 7 blocks of 16 tokens each, and the null block
    need = size_kv_cache(None, 4, 100, 16, 256, LIMITS)
    assert need.num_blocks == 4 * 7 + 1 and "the need of 4 sequences of 100 tokens" in need.limit
    # 256 x 8192 tokens of 23040 bytes (the default model) need 48 GB: the budget sets it
    budget = size_kv_cache(None, 256, 8192, 16, 23040, LIMITS)
    assert (budget.num_blocks, budget.limit) == (2 * GiB // (16 * 23040), "the budget")
    free = size_kv_cache(None, 256, 8192, 16, 23040, [*LIMITS, ("little free", 100 * MiB)])
    assert (free.num_blocks, free.limit) == (100 * MiB // (16 * 23040), "little free")


def test_a_cache_asked_for_is_that_size_whatever_the_need() -> None:
    asked = size_kv_cache(64 * MiB, 4, 100, 16, 256, LIMITS)
    assert asked.num_blocks == 64 * MiB // (16 * 256) and "kv_cache_memory" in asked.limit


def test_a_cache_of_fewer_than_two_blocks_is_an_error_that_names_the_limit() -> None:
    with pytest.raises(ValueError, match=r"holds 1 blocks of 16 tokens \(256 bytes a token\) within kv_cache_memory"):
        size_kv_cache(6000, 4, 100, 16, 256, LIMITS)
    with pytest.raises(ValueError, match="holds 0 blocks .* within no memory"):
        size_kv_cache(None, 4, 100, 16, 256, [("no memory", 0)])


def test_a_tiny_model_gets_megabytes_not_the_budget(tiny_llama_dir, caplog: pytest.LogCaptureFixture) -> None:
    """2 layers x 2 KV heads x 16 dims, keys and values in float16: 256 bytes a token, 512 positions."""
    with caplog.at_level(logging.INFO, logger="kvforge.engine.llm_engine"), \
            LLM(str(tiny_llama_dir[0]), enforce_eager=True) as llm:
        assert llm.engine.kv_cache_bytes() == (256 * 512 // 16 + 1) * 16 * 256  # 32 MiB, not 2 GiB
        assert llm.engine.max_model_len == 512
    assert "set by the need of 256 sequences of 512 tokens" in caplog.text
    with LLM(str(tiny_llama_dir[0]), enforce_eager=True, max_num_seqs=4, max_model_len=100) as llm:
        assert llm.engine.cache_stats().num_usable_blocks == 4 * 7
        assert llm.engine.max_model_len == 100


def test_the_memory_free_caps_a_cache_sized_by_default(tiny_llama_dir, monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(kv_cache_memory, "available_memory", lambda: WORKING_SET + 1 * MiB)
    with caplog.at_level(logging.INFO, logger="kvforge.engine.llm_engine"), \
            LLM(str(tiny_llama_dir[0]), enforce_eager=True) as llm:
        assert llm.engine.kv_cache_bytes() == 1 * MiB
        assert llm.engine.max_model_len == 512  # 255 blocks of 16 tokens still hold one whole sequence
    assert "set by the memory free (1 MiB beyond a working set)" in caplog.text


def test_the_default_model_keeps_its_93184_tokens(caplog: pytest.LogCaptureFixture) -> None:
    """256 sequences of 8192 tokens would need 48 GB; the CPU's 2 GiB budget holds 5824 blocks of 16 tokens, as the
    fixed 2 GiB cache did before the cache was sized to need."""
    if available_memory() < 2 * GiB + 2 * WORKING_SET:
        pytest.skip("less than ~3 GiB of memory free: the memory free, not the budget, would set the size")
    with caplog.at_level(logging.INFO, logger="kvforge.engine.llm_engine"), LLM(enforce_eager=True) as llm:
        assert llm.engine.kv_cache_manager.capacity_tokens == 93184
    assert "set by the CPU's default budget of 2 GiB" in caplog.text


def test_a_hybrid_models_states_bound_the_requests_that_run_at_once(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A running request of a hybrid model holds a slot of linear-attention states: by default max_num_seqs (256)
    slots would not fit, so the engine runs as many requests at once as fit in half the memory, and says so; every
    request still gets its tokens. Where not one fits, the error names the states' size."""
    build_hybrid_model("qwen3_5", save_tokenizer(tmp_path)).save_pretrained(tmp_path)
    prompts = [[5 + i, 9, 300, 41, 7 + i] for i in range(5)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with LLM(str(tmp_path), enforce_eager=True, kv_cache_memory="4MiB", max_num_seqs=8) as probe:
        worker = probe.engine.executor.worker
        slot = worker.kv_cache_spec.recurrent_state.bytes_per_slot(worker.loaded.dtype)
        expected = [o.outputs[0].token_ids for o in probe.generate(prompts, params)]
    fixed = slot * (1 + 8)  # the padding slot and the 8 checkpoints of the prefix cache
    monkeypatch.setattr(kv_cache_memory, "available_memory", lambda: WORKING_SET + 2 * (fixed + 3 * slot) + slot)
    with caplog.at_level(logging.INFO, logger="kvforge.executor.worker"), \
            LLM(str(tmp_path), enforce_eager=True) as llm:
        assert llm.engine.scheduler.config.max_num_seqs == 3
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert "at most 3 requests run at once (not max_num_seqs 256)" in caplog.text
    monkeypatch.setattr(kv_cache_memory, "available_memory", lambda: WORKING_SET + 2 * fixed)
    with pytest.raises(ValueError, match="linear-attention states .* do not fit in half of the memory free"):
        LLM(str(tmp_path), enforce_eager=True)
