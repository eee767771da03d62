"""LoRA of a MoE model's routed experts against PEFT + transformers, on a tiny random Qwen3-MoE: adapters of the
stacked experts (PEFT's target_parameters: gate_up_proj, down_proj, or both) beside attention projections, of
different ranks, and one of per-expert modules (experts.3.gate_proj, as transformers 4 named the experts). Greedy
tokens identical and logits within 1e-4 for each adapter alone and for one batch mixing three adapters and the base
model; the same with two tensor-parallel ranks and with the compiled decode step."""

from __future__ import annotations

import random

import pytest
import torch

from kvforge import LLM, LoRARequest, SamplingParams
from kvforge.kernels.cpu.extension import cpu_kernels
from tests.lora.adapters import greedy, logits, peft_model, save_adapter, save_per_expert_adapter

NUM_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
GATE_UP, DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
# (rank, target modules, target parameters, alpha, rsLoRA)
ADAPTERS = [(4, ["q_proj", "v_proj"], [GATE_UP, DOWN], 8.0, False), (8, ["o_proj"], [DOWN], 16.0, True),
            (6, ["k_proj"], [GATE_UP], 12.0, False)]
MIX = [0, 1, 2, None]  # the batch of three adapters and the base model (prompt i runs with key i; the base: the last)


@pytest.fixture(scope="module")
def moe_case(tmp_path_factory):
    """(base folder, LoRA requests, prompts (one per adapter, then the base's), {adapter index or None: PEFT's greedy
    tokens of its prompt}, PEFT models)."""
    from tests.models.test_moe_vs_transformers import build_moe_model
    from tests.tiny_models import save_tokenizer

    base = tmp_path_factory.mktemp("lora-moe-base")
    model = build_moe_model("qwen3_moe", save_tokenizer(base))
    model.save_pretrained(base)
    loras = []
    for i, (rank, modules, params, alpha, rslora) in enumerate(ADAPTERS):
        folder = save_adapter(base, tmp_path_factory.mktemp(f"moe-adapter-{i}"), rank, modules, seed=i, alpha=alpha,
                              rslora=rslora, parameters=params)
        loras.append(LoRARequest(f"moe-adapter-{i}", i + 1, str(folder)))
    per_expert = save_per_expert_adapter(base, tmp_path_factory.mktemp("moe-adapter-per-expert"), 4, seed=7)
    loras.append(LoRARequest("per-expert", len(loras) + 1, str(per_expert)))  # checked alone
    rng = random.Random(1)
    prompts = [[rng.randrange(3, model.config.vocab_size) for _ in range(n)] for n in (6, 19, 11, 27, 14)]
    refs = {**{i: peft_model(base, lora.path) for i, lora in enumerate(loras)}, None: model}
    expected = {key: greedy(ref, prompts[i], NUM_NEW) for i, (key, ref) in enumerate(refs.items())}
    return base, loras, prompts, expected, refs


def _prompt(case, key: int | None) -> list[int]:
    return case[2][-1 if key is None else key]


def _tokens(llm: LLM, prompts: list[list[int]], keys: list[int | None], loras: list[LoRARequest]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                           lora_request=[None if k is None else loras[k] for k in keys])
    return [o.outputs[0].token_ids for o in outputs]


def _experts_off(model, prompt: list[int]) -> torch.Tensor:
    """PEFT's logits with the adapter's expert B matrices zeroed for the while."""
    experts = {name: p for name, p in model.named_parameters() if ".experts." in name and "lora_B" in name}
    kept = {name: p.detach().clone() for name, p in experts.items()}
    with torch.no_grad():
        for p in experts.values():
            p.zero_()
        out = logits(model, prompt)
        for name, p in experts.items():
            p.copy_(kept[name])
    return out


def _check(llm: LLM, case) -> None:
    """Each adapter's logits and tokens, then one batch of three adapters and the base model."""
    _, loras, prompts, expected, refs = case
    for i, lora in enumerate(loras):
        ours = llm.engine.score(prompts[i], lora_request=lora)
        assert (ours - logits(refs[i], prompts[i])).abs().max().item() < 1e-4
        assert _tokens(llm, [prompts[i]], [i], loras) == [expected[i]]
    assert _tokens(llm, [_prompt(case, k) for k in MIX], MIX, loras) == [expected[k] for k in MIX]


def test_expert_adapters_alone_and_mixed_match_peft(moe_case) -> None:
    _, loras, prompts, _, refs = moe_case
    for i in range(len(loras)):  # each adapter's experts change the logits, not only its attention projections
        assert (_experts_off(refs[i], prompts[i]) - logits(refs[i], prompts[i])).abs().max().item() > 1e-2
    llm = LLM(str(moe_case[0]), kv_cache_memory="16MiB", kv_cache_dtype="float32", enable_lora=True, max_loras=4,
              lora_dtype="float32", max_lora_rank=8, enforce_eager=True)
    try:
        _check(llm, moe_case)
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_expert_adapters_on_two_ranks(moe_case, tp: int, pp: int) -> None:
    """Tensor parallel: each rank holds its half of every expert's intermediate dim (the rows of B of gate-up, the
    columns of A of down), and the layer's one all-reduce sums the adapters' partial products with the base's.
    Pipeline parallel: each stage takes its layers' experts of every adapter."""
    llm = LLM(str(moe_case[0]), kv_cache_memory="16MiB", kv_cache_dtype="float32", enable_lora=True, max_loras=4,
              lora_dtype="float32", max_lora_rank=8, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        _check(llm, moe_case)
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.skipif(cpu_kernels() is None, reason="compiled CPU steps need the C++ CPU kernels")
def test_compiled_decode_step_takes_the_expert_adapters_as_inputs(moe_case) -> None:
    """One compiled bucket (the gathered experts' path) replays steps of different adapter mixes."""
    _, loras, prompts, expected, _ = moe_case
    llm = LLM(str(moe_case[0]), kv_cache_memory="16MiB", kv_cache_dtype="float32", enable_lora=True, max_loras=3,
              lora_dtype="float32", max_lora_rank=8, compile_buckets=(4,))
    try:
        graphs = llm.engine.runner.decode_graphs
        graphs.compile_ahead(4)
        replays, run = [], graphs.run
        graphs.run = lambda *args: (replays.append(out := run(*args)), out)[1]
        for keys in ([0, 1, 2, None], [2, None, 0, 1]):
            assert _tokens(llm, [_prompt(moe_case, k) for k in keys], keys, loras) == [expected[k] for k in keys]
        assert graphs.compiled_buckets == (4,) and len(replays) == 2 * (NUM_NEW - 1)
        assert all(out is not None for out in replays)  # every decode step ran the compiled graph
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_mixtral_expert_adapter_matches_peft(tmp_path) -> None:
    """Mixtral (its checkpoint's block_sparse_moe is kvforge's mlp): an adapter of the stacked experts and of q_proj,
    alone and beside the base model in one batch."""
    from tests.models.test_moe_vs_transformers import build_moe_model
    from tests.tiny_models import save_tokenizer

    base = tmp_path / "mixtral"
    build_moe_model("mixtral", save_tokenizer(base)).save_pretrained(base)
    folder = save_adapter(base, tmp_path / "adapter", 4, ["q_proj"], seed=5, parameters=[GATE_UP, DOWN])
    lora = LoRARequest("mixtral-experts", 1, str(folder))
    ref = peft_model(base, folder)
    prompts = [[5, 9, 40, 77, 3, 120, 31], [8, 200, 11, 64, 19]]
    want = greedy(ref, prompts[0], NUM_NEW)
    with ref.disable_adapter():
        want_base = greedy(ref, prompts[1], NUM_NEW)
    llm = LLM(str(base), kv_cache_memory="16MiB", kv_cache_dtype="float32", enable_lora=True, max_lora_rank=8,
              lora_dtype="float32", enforce_eager=True)
    try:
        assert _tokens(llm, prompts, [0, None], [lora]) == [want, want_base]
        assert (llm.engine.score(prompts[0], lora_request=lora) - logits(ref, prompts[0])).abs().max().item() < 1e-4
        assert (_experts_off(ref, prompts[0]) - logits(ref, prompts[0])).abs().max().item() > 1e-2
    finally:
        llm.shutdown()
