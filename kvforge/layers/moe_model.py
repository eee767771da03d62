"""What every mixture-of-experts family shares: building its sparse MoE blocks and loading its experts.

Mixed into a decoder-stack model class, before it, so `load_tensor` reaches the stack's own loader:

    class MixtralForCausalLM(MoEModelMixin, LlamaForCausalLM): ...
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import torch
from torch import nn

from kvforge.distributed.parallel_state import get_parallel_state
from kvforge.layers.linear import Linear
from kvforge.layers.moe import FusedMoE, SparseMoeBlock, load_expert_tensor
from kvforge.layers.moe_router import Router, RoutingConfig


class MoEModelMixin:
    """Builds the MoE blocks and loads expert tensors for the MoE families (Mixtral, Qwen MoE, DeepSeek).

    NOTE: moe_block is the one place where FusedMoE is built: tensor- or expert-parallel sharding
    (FusedMoE's tp_rank, tp_size, expert_parallel) is wired here, not in the families."""

    checkpoint_renames: ClassVar[dict[str, str]] = {}  # checkpoint name fragment -> ours
    # The stack's dense MLP, built as dense_mlp_class(config with intermediate_size) for shared experts.
    dense_mlp_class: ClassVar[type[nn.Module] | None] = None
    config: Any  # the model's config dataclass (hidden_size, intermediate_size, ...)

    def moe_block(
        self, routing: RoutingConfig, moe_intermediate_size: int, shared_intermediate_size: int = 0,
        shared_expert_gate: bool = False,
    ) -> SparseMoeBlock:  # fmt: skip
        hidden = self.config.hidden_size
        state = get_parallel_state()
        shared = None
        if shared_intermediate_size:
            assert self.dense_mlp_class is not None, f"{type(self).__name__} has shared experts: set dense_mlp_class"
            shared = self.dense_mlp_class(replace(self.config, intermediate_size=shared_intermediate_size))
        return SparseMoeBlock(
            Router(hidden, routing),
            FusedMoE(routing.num_experts, hidden, moe_intermediate_size, state.tp_rank, state.tp_size,
                     dtype=self.config.dtype),
            shared_experts=shared,
            shared_expert_gate=Linear(hidden, [1], dtype=self.config.dtype) if shared_expert_gate else None,
        )

    def load_tensor(self, name: str, tensor: torch.Tensor, params: set[str]) -> str:
        for old, new in self.checkpoint_renames.items():
            name = name.replace(old, new)
        return load_expert_tensor(self, name, tensor) or super().load_tensor(name, tensor, params)
