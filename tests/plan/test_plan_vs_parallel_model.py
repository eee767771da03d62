"""The planner's per-rank arithmetic against the engine's own tensor- and pipeline-parallel model: the model
class built on the meta device as one rank of a TP x PP grid holds exactly the bytes the planner predicts."""

from __future__ import annotations

from functools import cache

import pytest
import torch

from kvforge.plan import PlanOptions, build_model_shape, get_device, make_plan
from kvforge.plan.estimate import split_problem
from kvforge.plan.model_shape import read_model_config
from kvforge.plan.precision import Precision
from kvforge.plan.stage import build_stages

parallel_state = pytest.importorskip("kvforge.distributed.parallel_state")


def _rank_model(hf_config: dict, tp: int, pp: int, stage: int):
    """The model as global rank (stage, tp index 0) builds it, on the meta device, in bfloat16."""
    from kvforge.models.registry import resolve_model_class

    state = parallel_state.ParallelState(rank=stage * tp, tp_size=tp, pp_size=pp)
    with parallel_state.building_with(state), torch.device("meta"):
        return resolve_model_class(hf_config)(hf_config, torch.bfloat16)


@cache
def _shape_and_config(name: str | None):
    display_name, hf_config = read_model_config(name)
    return build_model_shape(display_name, hf_config), hf_config


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("name", ["llama-3-70b", None, "mixtral-8x7b", "deepseek-v3"])
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (4, 2), (8, 1), (16, 1), (3, 1), (1, 4)])
def test_stage_bytes_match_the_rank_model(name, tp, pp):
    shape, hf_config = _shape_and_config(name)
    if any(size % tp for size in shape.tp_divisors) or (shape.num_kv_heads % tp and tp % shape.num_kv_heads):
        pytest.skip(f"TP={tp} does not split {shape.name}")
    if not hasattr(parallel_state.ParallelState, "layer_range"):
        pytest.skip("the engine's models are not pipeline-parallel here")
    stages = build_stages(shape, tp, pp, Precision("bf16", "bf16"), 2048, 256)
    for stage in stages:
        model = _rank_model(hf_config, tp, pp, stage.index)
        assert stage.weight_bytes == pytest.approx(_bytes(model.parameters()), rel=1e-6), f"stage {stage.index}"
        assert stage.buffer_bytes == _bytes(model.buffers())
        assert stage.kv_bytes_per_token == model.kv_cache_spec.bytes_per_token(torch.bfloat16)


def test_device_table_reuses_the_roofline_figures():
    from kvforge.platforms.device_specs import lookup_device_peak

    assert get_device("h200").peak == lookup_device_peak("NVIDIA H200")
    assert get_device("MI300X").peak == lookup_device_peak("AMD Instinct MI300X")


@pytest.mark.parametrize(("name", "tp"), [(None, 3), ("llama-3-70b", 8), ("llama-3-70b", 16)])
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_kv_cache_bytes_match_the_engine(name, tp, kv_cache_dtype):
    shape, hf_config = _shape_and_config(name)
    (stage,) = build_stages(shape, tp, 1, Precision("bf16", kv_cache_dtype), 2048, 256)
    model = _rank_model(hf_config, tp, 1, 0)
    spec = model.kv_cache_spec.with_kv_cache_dtype(kv_cache_dtype, torch.bfloat16)
    assert stage.kv_bytes_per_token == spec.bytes_per_token(torch.bfloat16)


@pytest.fixture(scope="module")
def tiny_hybrid_config(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from tests.tiny_models import build_hybrid_model, save_tokenizer

    folder = tmp_path_factory.mktemp("qwen3_5")
    build_hybrid_model("qwen3_5", save_tokenizer(folder)).save_pretrained(folder)
    return read_model_config(str(folder))


@pytest.mark.parametrize("tp", [1, 2])
def test_a_hybrid_models_states_match_the_rank_model(tiny_hybrid_config, tp):
    """Qwen3.5: full-attention layers' KV per token and linear-attention layers' state per request, as each rank's
    model allocates them; the plan's memory counts the states of every request it runs, its padding slot and the
    prefix cache's checkpoints, and runs no more requests than the states allow."""
    display_name, hf_config = tiny_hybrid_config
    shape = build_model_shape(display_name, hf_config)
    assert any(layer.state_fp32_values for layer in shape.layers)
    assert any(layer.kv_heads_values for layer in shape.layers)
    for stage in build_stages(shape, tp, 1, Precision("bf16", "bf16"), 2048, 256):
        spec = _rank_model(hf_config, tp, 1, stage.index).kv_cache_spec
        assert stage.kv_bytes_per_token == spec.bytes_per_token(torch.bfloat16)
        assert stage.state_bytes_per_seq == spec.recurrent_state.bytes_per_slot(torch.bfloat16)
    per_seq = build_stages(shape, 1, 1, Precision("bf16", "bf16"), 2048, 256)[0].state_bytes_per_seq
    device = get_device("cpu")  # whose KV cache and states take at most the engine's 2 GiB by default
    options = PlanOptions(context_len=256, max_num_seqs=10**6)
    (split,) = make_plan(shape, device, Precision("bf16", "bf16"), options).splits
    m = split.memory
    left = min(device.memory_bytes * 0.9 - (m.weights + m.buffers + m.packed_weights + m.activations), 2 * 2**30)
    requests = int(left / 2 // per_seq) - 9  # half of it, less the padding slot and 8 checkpoints
    assert split.max_batch <= requests and m.states == pytest.approx((requests + 9) * per_seq)
    # two stages of its 4 layers: one would hold no full-attention layer, which the engine refuses too
    assert "no full-attention layer" in split_problem(shape, 1, 2)
    with pytest.raises(ValueError, match="no full-attention layer"):
        _rank_model(hf_config, 1, 2, 0)
