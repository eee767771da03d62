"""The engine with the Triton kernels (interpreted on the CPU) gives the torch backend's greedy tokens."""

from __future__ import annotations

import pytest

from kvforge import LLM, SamplingParams

pytest.importorskip("triton")


def test_triton_backend_matches_torch_backend(tiny_llama_dir):
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 9, 21)]
    prompts.append({"prompt_token_ids": list(range(3, 3 + 18))})  # shares a cached block with the third
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    folder = str(tiny_llama_dir[0])
    expected = LLM(folder, kv_cache_memory="4MiB", attention_backend="torch").generate(prompts, params)
    triton_llm = LLM(folder, kv_cache_memory="4MiB", attention_backend="triton", max_num_batched_tokens=16)
    assert triton_llm.engine.attention_backend == "triton"
    got = triton_llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_two_engines_with_different_backends_in_one_process(tiny_llama_dir):
    """Each engine keeps the kernels it was built with, whatever the other one does in between."""
    folder = str(tiny_llama_dir[0])
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17)]
    torch_llm = LLM(folder, kv_cache_memory="4MiB", attention_backend="torch")
    triton_llm = LLM(folder, kv_cache_memory="4MiB", attention_backend="triton")
    expected = [o.outputs[0].token_ids for o in torch_llm.generate(prompts, params)]
    for llm in (triton_llm, torch_llm, triton_llm, torch_llm):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert {m.ops.backend for m in triton_llm.engine.local_model.modules() if hasattr(m, "ops")} == {"triton"}
    assert {m.ops.backend for m in torch_llm.engine.local_model.modules() if hasattr(m, "ops")} == {"torch"}
