"""MoE routing against the transformers routers of each family, and the experts layer's parallel slicing:
the ranks' partial outputs add up to the whole layer."""

from __future__ import annotations

import pytest
import torch

from kvforge.layers.moe import FusedMoE, load_expert_tensor
from kvforge.layers.moe_router import Router, RoutingConfig, select_experts
from kvforge.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

HIDDEN = 32
_DEEPSEEK = dict(hidden_size=HIDDEN, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                 routed_scaling_factor=2.5)  # fmt: skip


def _hf_router(family: str):
    """(transformers router, our RoutingConfig for the same HF config)."""
    import transformers as tf

    if family == "mixtral":
        hf = tf.MixtralConfig(hidden_size=HIDDEN, num_local_experts=8, num_experts_per_tok=2)
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter as router_class

        return router_class(hf), RoutingConfig(num_experts=8, top_k=2, renormalize=True)
    if family in ("qwen_moe", "qwen_moe_normalized"):
        hf = tf.Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=8, num_experts_per_tok=3,
                               norm_topk_prob=family == "qwen_moe_normalized")  # fmt: skip
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter as router_class

        return router_class(hf), RoutingConfig(num_experts=8, top_k=3, renormalize=hf.norm_topk_prob)
    if family == "deepseek_v2":
        hf = tf.DeepseekV2Config(topk_method="group_limited_greedy", **_DEEPSEEK)
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter as router_class

        return router_class(hf), DeepseekV2ForCausalLM.routing(hf.to_dict())
    hf = tf.DeepseekV3Config(**_DEEPSEEK)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter as router_class

    return router_class(hf), DeepseekV3ForCausalLM.routing(hf.to_dict())


def _sorted_by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("family", ["mixtral", "qwen_moe", "qwen_moe_normalized", "deepseek_v2", "deepseek_v3"])
def test_routing_matches_transformers(family: str) -> None:
    hf_router, routing = _hf_router(family)
    ours = Router(HIDDEN, routing)
    with torch.no_grad():
        hf_router.weight.normal_(0.0, 0.5)
        ours.weight.copy_(hf_router.weight)
        if routing.correction_bias:
            hf_router.e_score_correction_bias.normal_(0.0, 0.3)
            ours.e_score_correction_bias.copy_(hf_router.e_score_correction_bias)
    x = torch.randn(64, HIDDEN)
    _, hf_weights, hf_ids = hf_router(x)
    weights, ids = ours(x)
    hf_weights, hf_ids = _sorted_by_expert(hf_weights, hf_ids)
    weights, ids = _sorted_by_expert(weights, ids)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights.float(), atol=1e-6, rtol=1e-6)


def test_grouped_routing_stays_in_the_best_groups() -> None:
    cfg = RoutingConfig(num_experts=16, top_k=4, scoring="sigmoid", num_groups=4, topk_groups=2,
                        group_score="top2_sum", renormalize=True)  # fmt: skip
    logits = torch.randn(100, 16) * 3
    weights, ids = select_experts(logits, cfg)
    assert max(len(set(row)) for row in (ids // 4).tolist()) <= 2
    torch.testing.assert_close(weights.sum(-1), torch.ones(100))


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(top_k=9), "top_k"),
        (dict(num_groups=3), "num_groups"),
        (dict(num_groups=4, topk_groups=1, top_k=3), "top_k"),
        (dict(scoring="relu"), "scoring"),
    ],
)
def test_routing_config_rejects(bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RoutingConfig(**{"num_experts": 8, "top_k": 2, **bad})


def _load_experts(layer: torch.nn.Module, experts: list[dict[str, torch.Tensor]]) -> None:
    for e, weights in enumerate(experts):
        for proj, tensor in weights.items():
            assert load_expert_tensor(layer, f"moe.experts.{e}.{proj}.weight", tensor) is not None


@pytest.mark.parametrize("tp_size, expert_parallel", [(2, False), (4, False), (2, True), (4, True)])
def test_parallel_slices_sum_to_the_whole_layer(tp_size: int, expert_parallel: bool) -> None:
    num_experts, inter = 8, 16
    experts = [{"w1": torch.randn(inter, HIDDEN), "w3": torch.randn(inter, HIDDEN),
                "w2": torch.randn(HIDDEN, inter)} for _ in range(num_experts)]  # fmt: skip
    x = torch.randn(11, HIDDEN)
    topk_weights, topk_ids = torch.rand(11, 2), torch.stack([torch.randperm(num_experts)[:2] for _ in range(11)])

    def run(rank: int, size: int) -> torch.Tensor:
        holder = torch.nn.Module()
        holder.moe = torch.nn.Module()
        holder.moe.experts = FusedMoE(num_experts, HIDDEN, inter, rank, size, expert_parallel)
        _load_experts(holder, experts)
        return holder.moe.experts(x, topk_weights, topk_ids)

    whole = run(0, 1)
    torch.testing.assert_close(sum(run(rank, tp_size) for rank in range(tp_size)), whole, atol=1e-4, rtol=1e-5)


def test_fused_moe_rejects_uneven_split() -> None:
    with pytest.raises(ValueError, match="divisible"):
        FusedMoE(num_experts=6, hidden_size=8, intermediate_size=16, tp_rank=0, tp_size=4, expert_parallel=True)
