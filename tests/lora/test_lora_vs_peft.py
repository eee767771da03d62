"""LoRA adapters against PEFT + transformers on tiny random models: greedy tokens identical and logits within 1e-4,
for each adapter alone and for one batch mixing three adapters and the base model (float32 slots; bfloat16 ones
within their rounding); prefix caching per adapter."""

from __future__ import annotations

import random

import pytest
import torch

from kvforge import LLM, LoRARequest, SamplingParams
from kvforge.kernels.cpu.extension import cpu_kernels
from tests.lora.adapters import ALL_TARGETS, greedy, logits, peft_model, save_adapter
from tests.tiny_models import save_model

needs_cpu_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="compiled CPU steps need the C++ CPU kernels")
NUM_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
# (rank, targets, alpha, rsLoRA): ranks differ, and each adapter covers different modules of the merged layers
ADAPTERS = [(4, ALL_TARGETS, 8.0, False), (16, ["q_proj", "v_proj", "o_proj", "up_proj"], 16.0, True),
            (7, ["k_proj", "gate_proj", "down_proj"], 32.0, False)]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def lora_case(request, tmp_path_factory):
    """(base folder, LoRA requests, prompts, {adapter index or None: PEFT's greedy tokens per prompt}, PEFT models)."""
    base = tmp_path_factory.mktemp(f"lora-base-{request.param}")
    model = save_model(base, request.param)
    loras = []
    for i, (rank, targets, alpha, rslora) in enumerate(ADAPTERS):
        folder = save_adapter(base, tmp_path_factory.mktemp(f"adapter-{i}"), rank, targets, seed=i, alpha=alpha,
                              rslora=rslora)
        loras.append(LoRARequest(f"adapter-{i}", i + 1, str(folder)))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, model.config.vocab_size) for _ in range(n)] for n in (5, 21, 36, 12)]
    refs = {None: model, **{i: peft_model(base, lora.path) for i, lora in enumerate(loras)}}
    expected = {key: [greedy(ref, p, NUM_NEW) for p in prompts] for key, ref in refs.items()}
    return base, loras, prompts, expected, refs


@pytest.fixture(scope="module")
def lora_llm(lora_case):
    # NOTE: eager: the compiled step has a test of its own, and this engine compiled in the background otherwise
    llm = LLM(str(lora_case[0]), kv_cache_memory="16MiB", kv_cache_dtype="float32", enable_lora=True, max_loras=4,
              lora_dtype="float32", max_lora_rank=16, enforce_eager=True)
    yield llm
    llm.shutdown()


def _tokens(llm: LLM, prompts: list[list[int]], loras) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=loras)
    return [o.outputs[0].token_ids for o in outputs]


def test_each_adapter_alone_matches_peft(lora_case, lora_llm) -> None:
    _, loras, prompts, expected, refs = lora_case
    for i, lora in enumerate(loras):
        assert expected[i] != expected[None]  # the adapter changes the answers
        assert _tokens(lora_llm, prompts, lora) == expected[i]
        ours = lora_llm.engine.score(prompts[2], lora_request=lora)
        assert (ours - logits(refs[i], prompts[2])).abs().max().item() < 1e-4


def test_one_batch_of_three_adapters_and_the_base_model_matches_peft(lora_case, lora_llm) -> None:
    _, loras, prompts, expected, _ = lora_case
    keys = [0, 1, 2, None] * 2
    batch = [prompts[(i + 1) % 4] for i in range(len(keys))]
    got = _tokens(lora_llm, batch, [None if k is None else loras[k] for k in keys])
    assert got == [expected[k][(i + 1) % 4] for i, k in enumerate(keys)]


def test_prefix_cache_is_per_adapter(lora_case, lora_llm) -> None:
    _, loras, prompts, expected, _ = lora_case
    prompt = {"prompt_token_ids": prompts[2]}  # 36 tokens: two full blocks of 16
    lora_llm.reset_caches()
    first = lora_llm.generate(prompt, GREEDY, lora_request=loras[0])[0]
    other = lora_llm.generate(prompt, GREEDY, lora_request=loras[1])[0]
    base = lora_llm.generate(prompt, GREEDY)[0]
    again = lora_llm.generate(prompt, GREEDY, lora_request=loras[0])[0]
    assert (first.num_cached_tokens, other.num_cached_tokens, base.num_cached_tokens) == (0, 0, 0)
    assert again.num_cached_tokens == 32
    assert [o.outputs[0].token_ids for o in (first, other, base, again)] == [
        expected[0][2], expected[1][2], expected[None][2], expected[0][2]]


@needs_cpu_kernels
@pytest.mark.parametrize("lora_case", ["llama"], indirect=True)
def test_bfloat16_adapters_stay_close_to_peft(lora_case) -> None:
    """lora_dtype auto where the C++ op runs the LoRA layers: the slots in bfloat16 (half the bytes a decode step
    streams), the products summed in float32. Against PEFT in float32: one batch of three adapters and the base model
    gives the same greedy tokens, and each adapter's logits part from PEFT's by a small fraction of what the adapter
    changes (bfloat16 keeps 8 bits of each weight: a relative error up to 2^-9 per weight)."""
    base, loras, prompts, expected, refs = lora_case
    llm = LLM(str(base), kv_cache_memory="16MiB", kv_cache_dtype="float32", enable_lora=True, max_loras=4,
              max_lora_rank=16, enforce_eager=True)
    try:
        assert {layer.a.dtype for layer in llm.engine.runner.lora.layers.values()} == {torch.bfloat16}
        keys = [0, 1, 2, None]
        assert _tokens(llm, prompts, [None if k is None else loras[k] for k in keys]) == [
            expected[k][i] for i, k in enumerate(keys)]
        base_logits = logits(refs[None], prompts[2])
        for i, lora in enumerate(loras):
            want = logits(refs[i], prompts[2])
            error = (llm.engine.score(prompts[2], lora_request=lora) - want).abs().max().item()
            effect = (want - base_logits).abs().max().item()
            # measured: errors 1.7e-3 to 3.3e-3 against effects of 0.68 to 0.81
            assert error < 1e-2 and error < effect / 50, (error, effect)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("lora_case", ["llama"], indirect=True)
def test_more_adapters_than_slots_take_turns(lora_case) -> None:
    """One slot (and one adapter kept on the host): each adapter's requests wait until the previous adapter's
    finish, its weights read again and swapped in; the base model's requests run beside any of them."""
    base, loras, prompts, expected, _ = lora_case
    llm = LLM(str(base), kv_cache_memory="16MiB", kv_cache_dtype="float32", enable_lora=True, max_loras=1,
              lora_dtype="float32", enforce_eager=True)
    try:
        keys = [0, 1, None, 2, 0, None, 1, 2]
        batch = [prompts[i % 4] for i in range(len(keys))]
        assert _tokens(llm, batch, [None if k is None else loras[k] for k in keys]) == [
            expected[k][i % 4] for i, k in enumerate(keys)]
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("lora_case", ["qwen3"], indirect=True)
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_parallel_adapters_match_peft(lora_case, tp: int, pp: int) -> None:
    """Two ranks. Tensor parallel: each holds its share of every adapter (B cut by output rows in QKV and gate-up, A by
    input columns in the output and down projections); pipeline parallel: each stage its layers' part. One batch of
    three adapters and the base model, and the logits of each adapter."""
    base, loras, prompts, expected, refs = lora_case
    llm = LLM(str(base), kv_cache_memory="16MiB", kv_cache_dtype="float32", enable_lora=True, max_loras=3,
              lora_dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        keys = [0, 1, 2, None]
        assert _tokens(llm, prompts, [None if k is None else loras[k] for k in keys]) == [
            expected[k][i] for i, k in enumerate(keys)]
        for i, lora in enumerate(loras):
            ours = llm.engine.score(prompts[1], lora_request=lora)
            assert (ours - logits(refs[i], prompts[1])).abs().max().item() < 1e-4
    finally:
        llm.shutdown()


@pytest.mark.slow
@needs_cpu_kernels
@pytest.mark.parametrize("lora_case", ["llama"], indirect=True)
def test_compiled_decode_step_takes_the_adapters_as_inputs(lora_case) -> None:
    """One compiled bucket replays steps of different adapter mixes: the slot ids and the slots' weights are inputs
    of its graph (a graph that had baked them in would give the first mix's tokens to every later one)."""
    base, loras, prompts, expected, _ = lora_case
    llm = LLM(str(base), kv_cache_memory="16MiB", kv_cache_dtype="float32", enable_lora=True, max_loras=2,
              lora_dtype="float32", compile_buckets=(4,))
    try:
        graphs = llm.engine.runner.decode_graphs
        graphs.compile_ahead(4)
        replays, run = [], graphs.run
        graphs.run = lambda *args: (replays.append(out := run(*args)), out)[1]
        for keys in ([0, 1, None, 0], [2, None, 2, 1], [None, None, None, None]):
            got = _tokens(llm, prompts, [None if k is None else loras[k] for k in keys])
            assert got == [expected[k][i] for i, k in enumerate(keys)]
        assert graphs.compiled_buckets == (4,) and len(replays) == 3 * (NUM_NEW - 1)
        assert all(out is not None for out in replays)
    finally:
        llm.shutdown()
