"""The planner's per-rank arithmetic against the engine's own tensor- and pipeline-parallel model: the model
class built on the meta device as one rank of a TP x PP grid holds exactly the bytes the planner predicts."""

from __future__ import annotations

from functools import cache

import pytest
import torch

from kvforge.plan import build_model_shape, get_device
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
