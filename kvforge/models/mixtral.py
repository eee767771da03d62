"""Mixtral, and the base of every mixture-of-experts family here: the Llama decoder stack with sparse MoE
blocks (router, fused routed experts, optional shared experts) in place of some or all dense MLPs."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from kvforge.distributed.parallel_state import get_parallel_state
from kvforge.layers.linear import Linear
from kvforge.layers.moe import FusedMoE, SparseMoeBlock, load_expert_tensor
from kvforge.layers.moe_router import Router, RoutingConfig
from kvforge.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


class MoELlamaForCausalLM(LlamaForCausalLM):
    """Builds the MoE blocks and loads expert tensors for its subclasses.

    NOTE: moe_block is the one place where FusedMoE is built: tensor- or expert-parallel sharding
    (FusedMoE's tp_rank, tp_size, expert_parallel) is wired here, not in the families."""

    checkpoint_renames: dict[str, str] = {}  # checkpoint name fragment -> ours

    def moe_block(
        self, routing: RoutingConfig, moe_intermediate_size: int, shared_intermediate_size: int = 0,
        shared_expert_gate: bool = False,
    ) -> SparseMoeBlock:  # fmt: skip
        hidden = self.config.hidden_size
        state = get_parallel_state()
        shared = None
        if shared_intermediate_size:
            shared = LlamaMLP(replace(self.config, intermediate_size=shared_intermediate_size))
        return SparseMoeBlock(
            Router(hidden, routing),
            FusedMoE(routing.num_experts, hidden, moe_intermediate_size, state.tp_rank, state.tp_size),
            shared_experts=shared,
            shared_expert_gate=Linear(hidden, [1]) if shared_expert_gate else None,
        )

    def load_tensor(self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]) -> str:
        for old, new in self.checkpoint_renames.items():
            name = name.replace(old, new)
        return load_expert_tensor(self, name, tensor) or super().load_tensor(name, tensor, params)


class MixtralForCausalLM(MoELlamaForCausalLM):
    """Every layer's MLP is a mixture of experts: softmax over the experts, top-k renormalized."""

    checkpoint_renames = {".block_sparse_moe.": ".mlp."}

    def make_layer(self, hf_config: dict, layer_idx: int) -> nn.Module:
        routing = RoutingConfig(num_experts=hf_config["num_local_experts"],
                                top_k=hf_config["num_experts_per_tok"], renormalize=True)  # fmt: skip
        return LlamaDecoderLayer(self.config, self.rotary, mlp=self.moe_block(routing, self.config.intermediate_size))
