"""`kvforge plan`'s KV bytes of sliding-window models against the KV cache manager stepped by hand: a sequence of
Gemma 3 12B's and GPT-OSS-20b's shapes (the configs shipped with kvforge) decoded a token at a time holds at most the
blocks the plan counts for its context, sliding-window layers only their windows."""

from __future__ import annotations

import pytest
import torch

from kvforge.benchmarks.kv_window_memory import kv_spec, read_config
from kvforge.config import CacheConfig
from kvforge.engine.kv_cache_manager import KVCacheManager
from kvforge.engine.request import Request
from kvforge.plan import build_model_shape
from kvforge.plan.precision import Precision
from kvforge.plan.stage import build_stages
from kvforge.sampling_params import SamplingParams


def _most_bytes_held(name: str, context: int) -> int:
    """The most cache bytes one sequence of context tokens holds while its tokens are computed one at a time."""
    spec = kv_spec(read_config(name))
    block_size = CacheConfig().block_size
    num_blocks = 2 + len(spec.layer_groups()) * (context // block_size + 1)
    kv = KVCacheManager(num_blocks, block_size, False, spec.layer_groups())
    request = Request("a", list(range(context)), SamplingParams(max_tokens=1))
    most = 0
    for num_computed in range(context):
        request.num_computed_tokens = num_computed
        assert kv.allocate_slots(request, 1)
        most = max(most, num_blocks - 1 - kv.num_free_blocks)
    kv.free(request)
    assert kv.num_free_blocks == num_blocks - 1
    return most * block_size * spec.bytes_per_token(torch.bfloat16)


@pytest.mark.parametrize(("name", "context"), [("gemma-3-12b", 4096), ("gpt-oss-20b", 1024), ("gpt-oss-20b", 2000)])
def test_plan_counts_the_blocks_the_manager_holds(name: str, context: int) -> None:
    from kvforge.plan.model_shape import read_model_config

    display_name, hf_config = read_model_config(name)
    stage = build_stages(build_model_shape(display_name, hf_config), 1, 1, Precision("bf16", "bf16"), 2048, 256,
                         context_len=context)[0]  # fmt: skip
    held = _most_bytes_held(name, context)
    assert stage.kv_bytes_per_token * context == pytest.approx(held, rel=1e-9)
    # every layer's tokens would take more: the windows save
    full = hf_config["num_hidden_layers"] * 2 * hf_config["num_key_value_heads"] * hf_config["head_dim"] * 2 * context
    assert held < full
