"""The engine with the Triton kernels (interpreted on the CPU) gives the torch backend's greedy tokens."""

from __future__ import annotations

import pytest

from kvforge import LLM, SamplingParams
from kvforge.kernels import tuning
from kvforge.platforms import Platform, pin_platform

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


def test_two_engines_launch_with_the_tiles_of_the_platform_each_was_built_for(tiny_llama_dir, monkeypatch):
    """The platform (whose tuning table picks the tiles, whose size picks the decode splits) belongs to the engine:
    its op table captures it when the model is built. Two engines built for an H100's and an MI300's tables launch,
    in turns, every kernel with their own, and both give the torch backend's tokens."""
    folder = str(tiny_llama_dir[0])
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(5, 10))}]  # the prefill kernel, then a decode
    options = dict(device="cpu", kv_cache_memory="4MiB", enforce_eager=True)
    expected = [o.outputs[0].token_ids for o in LLM(folder, attention_backend="torch", **options).generate(prompts,
                                                                                                           params)]
    platforms = [Platform("cuda", "NVIDIA H100", "sm_90", 32, 132, 80 << 30, None),
                 Platform("rocm", "AMD Instinct MI300X", "gfx942", 64, 304, 192 << 30, None)]
    engines = {}
    for platform in platforms:
        with pin_platform(platform):
            engines[platform.arch] = LLM(folder, attention_backend="triton", **options)
    launched = []
    table = tuning.tuning_for_arch
    monkeypatch.setattr(tuning, "tuning_for_arch", lambda arch: launched.append(arch) or table(arch))
    for arch in ("sm_90", "gfx942", "sm_90"):
        launched.clear()
        assert [o.outputs[0].token_ids for o in engines[arch].generate(prompts, params)] == expected
        assert launched and set(launched) == {arch}
