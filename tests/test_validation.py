"""Bad input gets a clear ValueError, and nothing already accepted is lost."""

from __future__ import annotations

import json

import pytest

from kvforge import LLM, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -0.1}, "temperature"),
        ({"n": 0}, "n must be"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logprobs": 50}, "logprobs"),
        ({"seed": 2**64}, "seed"),
        ({"top_k": 2**63}, "top_k"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_empty_and_too_long_prompts_rejected_without_losing_others(tiny_llm):
    with pytest.raises(ValueError, match="empty"):
        tiny_llm.generate([""])
    with pytest.raises(ValueError, match="prompt has 600 tokens"):
        tiny_llm.generate([{"prompt_token_ids": [5] * 600}])
    with pytest.raises(ValueError, match="token ids must be integers"):
        tiny_llm.generate([{"prompt_token_ids": [10**7]}])
    with pytest.raises(ValueError, match="stop_token_ids"):
        tiny_llm.generate(["fine"], SamplingParams(stop_token_ids=[10**9], min_tokens=2))
    with pytest.raises(ValueError, match="empty"):
        tiny_llm.generate(["fine prompt", ""])  # the first was accepted, then withdrawn
    assert not tiny_llm.engine.has_unfinished_requests()
    cache = tiny_llm.engine.cache_stats()
    assert cache.num_free_blocks == cache.num_usable_blocks
    assert tiny_llm.generate(["fine prompt"], SamplingParams(max_tokens=3))[0].outputs[0].token_ids


def test_generation_stops_at_the_context_length(tiny_llm):
    out = tiny_llm.generate([{"prompt_token_ids": [5] * 500}], SamplingParams(max_tokens=100, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 12 and out[0].outputs[0].finish_reason == "length"


def test_bad_models(tmp_path, tiny_llama_dir):
    with pytest.raises(ValueError, match="not found"):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(tmp_path))
    folder = tiny_llama_dir[0]
    broken = tmp_path / "arch"
    broken.mkdir()
    config = json.loads((folder / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "architectures": ["NopeForCausalLM"]}))
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(broken))
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"definitely not a gguf file")
    with pytest.raises(ValueError):
        LLM(str(not_gguf))
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(str(folder), kv_cache_memory="1KiB")
    with pytest.raises(ValueError, match="memory size"):
        LLM(str(folder), kv_cache_memory="lots")
