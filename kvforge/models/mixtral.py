"""Mixtral: the Llama decoder stack with a sparse mixture-of-experts block in place of every dense MLP
(the MoE part every family shares is kvforge.layers.moe_model)."""

from __future__ import annotations

from torch import nn

from kvforge.layers.moe_model import MoEModelMixin
from kvforge.layers.moe_router import RoutingConfig
from kvforge.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class MixtralForCausalLM(MoEModelMixin, LlamaForCausalLM):
    """Every layer's MLP is a mixture of experts: softmax over the experts, top-k renormalized."""

    checkpoint_renames = {".block_sparse_moe.": ".mlp."}

    def make_layer(self, hf_config: dict, layer_idx: int) -> nn.Module:
        routing = RoutingConfig(num_experts=hf_config["num_local_experts"],
                                top_k=hf_config["num_experts_per_tok"], renormalize=True)  # fmt: skip
        return LlamaDecoderLayer(self.config, self.rotary, mlp=self.moe_block(routing, self.config.intermediate_size))
