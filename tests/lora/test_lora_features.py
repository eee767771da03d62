"""Speculative decoding (n-gram drafts verified with the adapter) and structured output with LoRA adapters, against
PEFT + transformers."""

from __future__ import annotations

import random

import pytest
import torch

from kvforge import LLM, LoRARequest, SamplingParams
from tests.lora.adapters import ALL_TARGETS, greedy, logits, peft_model, save_adapter

NUM_NEW = 12


@pytest.fixture(scope="module")
def spec_case(tiny_llama_dir, tmp_path_factory):
    """(engine drafting by n-gram lookup, two adapters, PEFT models by adapter index, prompts)."""
    base = tiny_llama_dir[0]
    loras = [LoRARequest(f"ad{i}", i + 1, str(save_adapter(base, tmp_path_factory.mktemp(f"ad{i}"), rank, targets,
                                                             seed=10 + i)))
             for i, (rank, targets) in enumerate([(8, ALL_TARGETS), (4, ["q_proj", "o_proj", "up_proj"])])]
    refs = [peft_model(base, lora.path) for lora in loras]
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 300) for _ in range(6)] * 3 for _ in range(3)]  # repeats: the n-grams to draft
    llm = LLM(str(base), kv_cache_memory="16MiB", kv_cache_dtype="float32", enable_lora=True, max_loras=2,
              lora_dtype="float32", max_lora_rank=8, speculative_method="ngram", num_speculative_tokens=3,
              enforce_eager=True)
    yield llm, loras, refs, prompts
    llm.shutdown()


def test_drafts_are_verified_with_each_requests_adapter(spec_case) -> None:
    llm, loras, refs, prompts = spec_case
    keys = [0, 1, None]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                           lora_request=[None if k is None else loras[k] for k in keys])
    base_model = refs[0].get_base_model()
    with refs[0].disable_adapter():
        want_base = greedy(base_model, prompts[2], NUM_NEW)
    assert [o.outputs[0].token_ids for o in outputs] == [greedy(refs[0], prompts[0], NUM_NEW),
                                                        greedy(refs[1], prompts[1], NUM_NEW), want_base]
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0


def test_structured_output_with_an_adapter(spec_case) -> None:
    """A choice of one-token strings: greedy takes the choice the adapter's logits rank first."""
    llm, loras, refs, prompts = spec_case
    choices = ["x", "y", "z", "q"]
    tokenizer = llm.get_tokenizer()
    choice_ids = [tokenizer.encode(c, add_special_tokens=False) for c in choices]
    assert all(len(ids) == 1 for ids in choice_ids)
    params = SamplingParams(temperature=0.0, max_tokens=4, guided_choice=choices)
    for i, lora in enumerate(loras):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=lora)
        for prompt, output in zip(prompts, outputs, strict=True):
            last = logits(refs[i], prompt)[-1]
            best = choices[int(torch.argmax(last[[ids[0] for ids in choice_ids]]))]
            assert output.outputs[0].text == best
