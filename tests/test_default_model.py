"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF from PyPI) against transformers on the same file."""

from __future__ import annotations

import pytest
import torch

from kvforge import LLM, SamplingParams

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "List three prime numbers."}],
]
NUM_NEW = 24


@pytest.fixture(scope="module")
def default_llm():
    # NOTE: one bucket, the graph of 4 (Python's wrapper), for the four conversations and, padded, the single
    # requests: a cold compile of the default model in bucket 1's C++ wrapper alone took ~70 s of the default
    # suite's 15 minutes. That wrapper is checked against eager on every tiny family (tests/executor), and it is
    # what `kvforge generate` and the decode benchmarks run.
    # quantization="none" and a float32 cache: the float model transformers runs (the file's Q4_1 weights
    # dequantized); the defaults (kept weights, a float16 cache) are tests/quantization/test_gguf_kept.py's
    llm = LLM(kv_cache_memory="256MiB", compile_buckets=(4,), quantization="none", kv_cache_dtype="float32")
    llm.engine.runner.decode_graphs.compile_ahead(4)  # every decode step compiled: not some, as a compile ends
    return llm


def test_chat_greedy_matches_transformers(default_llm, hf_default_tokenizer, hf_default_model):
    hf_tokenizer, hf_model = hf_default_tokenizer, hf_default_model
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW)  # stops at <|im_end|>, as transformers does
    outputs = default_llm.chat(CONVERSATIONS, params)
    for conversation, output in zip(CONVERSATIONS, outputs):
        prompt_ids = hf_tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)
        assert output.prompt_token_ids == list(prompt_ids)
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=NUM_NEW, do_sample=False,
                                    pad_token_id=hf_tokenizer.eos_token_id)
        assert output.outputs[0].token_ids == ref[0, len(prompt_ids):].tolist()


def test_capital_of_france_is_paris(default_llm):
    out = default_llm.chat(CONVERSATIONS[0], SamplingParams(temperature=0.0, max_tokens=32))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # the model ends its answer with <|im_end|>


def test_streaming_text_never_splits_a_character(default_llm):
    engine = default_llm.engine
    engine.add_request("emoji", "Translate to Japanese and add emoji: I love the sea",
                       SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    seen = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen.append(output.outputs[0].text)
    assert all("\ufffd" not in text for text in seen)
    assert all(later.startswith(earlier) for earlier, later in zip(seen, seen[1:]))
    final = seen[-1]
    assert final == default_llm.get_tokenizer().decode(output.outputs[0].token_ids)
