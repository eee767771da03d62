"""The engine with the Triton kernels (interpreted on the CPU) gives the torch backend's greedy tokens."""

from __future__ import annotations

import pytest

from kvforge import LLM, SamplingParams
from kvforge.kernels import ops

pytest.importorskip("triton")


def test_triton_backend_matches_torch_backend(tiny_llama_dir):
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 9, 21)]
    prompts.append({"prompt_token_ids": list(range(3, 3 + 18))})  # shares a cached block with the third
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    folder = str(tiny_llama_dir[0])
    try:
        expected = LLM(folder, kv_cache_memory="4MiB", attention_backend="torch").generate(prompts, params)
        triton_llm = LLM(folder, kv_cache_memory="4MiB", attention_backend="triton",
                         max_num_batched_tokens=16)
        assert triton_llm.engine.attention_backend == "triton"
        got = triton_llm.generate(prompts, params)
    finally:
        ops.set_backend("torch")
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
