"""Qwen2-MoE (a sigmoid-gated shared expert beside the routed ones, QKV bias) and Qwen3-MoE (per-head
q/k RMSNorm, no shared expert). Layers in mlp_only_layers, or off the decoder_sparse_step, stay dense."""

from __future__ import annotations

from torch import nn

from kvforge.layers.moe_model import MoEModelMixin
from kvforge.layers.moe_router import RoutingConfig
from kvforge.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


def num_experts(hf_config: dict) -> int:
    """Checkpoints name it num_experts; transformers >= 5 saves num_local_experts."""
    return hf_config.get("num_experts", hf_config.get("num_local_experts", 0))


def is_sparse_layer(hf_config: dict, layer_idx: int) -> bool:
    step = hf_config.get("decoder_sparse_step") or 1
    return (
        num_experts(hf_config) > 0
        and layer_idx not in (hf_config.get("mlp_only_layers") or [])
        and (layer_idx + 1) % step == 0
    )


class Qwen2MoeForCausalLM(MoEModelMixin, LlamaForCausalLM):
    qkv_bias = True
    dense_mlp_class = LlamaMLP
    checkpoint_renames = {".shared_expert.": ".shared_experts."}

    def make_layer(self, hf_config: dict, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(hf_config, layer_idx):
            return LlamaDecoderLayer(self.config, self.rotary)
        routing = RoutingConfig(
            num_experts=num_experts(hf_config),
            top_k=hf_config["num_experts_per_tok"],
            renormalize=hf_config.get("norm_topk_prob", False),
        )
        shared = hf_config.get("shared_expert_intermediate_size") or 0
        moe_intermediate = hf_config["moe_intermediate_size"]
        block = self.moe_block(routing, moe_intermediate, shared, shared_expert_gate=bool(shared))
        return LlamaDecoderLayer(self.config, self.rotary, mlp=block)


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    qkv_bias = False
    qk_norm = True
