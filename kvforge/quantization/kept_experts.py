"""Routed experts kept in a GGUF file's quantized blocks on the CPU: each expert's gate and up (merged, [gate | up]
rows) and its down projection become weight-only kernels of their own (the panel kernel's layout where it runs:
what the dense layers of the same file use, packed expert by expert, never a float copy of the experts), and the
layer's MoE multiplies each active expert's gathered tokens with them (kernels/fused_moe.py's fused_moe_per_expert;
panel-packed experts through the custom op kernels/cpu/panel_moe.py, which a compiled decode step takes).

    checkpoint  model.layers.{i}.mlp.experts.{j}.{gate_proj,up_proj,down_proj}.weight: QuantizedWeights
    FusedMoE    gate_up_proj and down_proj dropped; kept = KeptExperts (its gate_up[j], down[j] kernels)

Experts stay float (the checkpoint's weights dequantized as they load) on a GPU, where the grouped GEMM over the
stacked float experts runs, and when a tensor- or expert-parallel rank holds a share of them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from torch import nn

import kvforge.kernels.cpu.panel_moe  # noqa: F401  (registers torch.ops.kvforge.panel_moe)
from kvforge.kernels.fused_moe import fused_moe_per_expert
from kvforge.layers.moe import FusedMoE
from kvforge.quantization.gguf_blocks import BlockLayout
from kvforge.quantization.quantized_weight import QuantizedWeight, RowShards
from kvforge.quantization.weight_only_kernels import PanelKernel, WeightOnlyKernel, select_kernel

logger = logging.getLogger(__name__)
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class KeptExperts(nn.Module):
    """A layer's experts as weight-only kernels: gate_up[j] (x -> [gate | up]) and down[j]."""

    def __init__(self, gate_up: list[WeightOnlyKernel], down: list[WeightOnlyKernel]) -> None:
        super().__init__()
        self.gate_up, self.down = nn.ModuleList(gate_up), nn.ModuleList(down)
        self.panels = all(_plain_panels(kernels) for kernels in (gate_up, down))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.panels:  # one opaque op, which a compiled decode step takes
            return torch.ops.kvforge.panel_moe(
                x, topk_weights, topk_ids, [k.weight for k in self.gate_up], [k.weight for k in self.down],
                [k.factor for k in self.gate_up], [k.factor for k in self.down], self.gate_up[0].bits,
                self.down[0].bits, self.gate_up[0].out_features)  # fmt: skip
        return self._per_expert(x, topk_weights, topk_ids)

    # NOTE: each expert's token count is a host sync, which a compiled decode step cannot trace: the engine runs such a
    # model's decode steps eagerly (with a warning) rather than read every expert's weights each step
    @torch.compiler.disable
    def _per_expert(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_moe_per_expert(x, topk_weights, topk_ids, [k.apply for k in self.gate_up],
                                    [k.apply for k in self.down])  # fmt: skip

    def weight_bytes(self) -> int:
        """Bytes of the experts as the kernels keep them."""
        return sum(t.nbytes for t in self.buffers())


def _plain_panels(kernels: list[WeightOnlyKernel]) -> bool:
    """Panel kernels of one bit width and row count, without a column permutation or a bias (the panel_moe op's)."""
    return (all(isinstance(k, PanelKernel) and k.perm is None and k.bias is None for k in kernels)
            and len({(k.bits, k.out_features) for k in kernels}) == 1)  # fmt: skip


def keep_experts_quantized(model: nn.Module, kept: Mapping[str, QuantizedWeight],
                           layouts: Mapping[str, BlockLayout]) -> set[str]:  # fmt: skip
    """Before loading: every FusedMoE on the CPU, not sharded, whose experts' weights are all in kept (HF weight name ->
    QuantizedWeight, decoded when read) gets them as KeptExperts; returns the names it took (the others load as
    float weights)."""
    taken: set[str] = set()
    for module_name, module in model.named_modules():
        if not isinstance(module, FusedMoE) or module.gate_up_proj.device.type != "cpu":
            continue
        if module.num_local_experts != module.num_experts or module.local_intermediate != module.intermediate_size:
            continue
        names = [[f"model.{module_name}.{j}.{proj}.weight" for proj in _PROJECTIONS] for j in range(module.num_experts)]
        if not all(name in layouts for expert in names for name in expert):
            continue
        dtype, device = module.gate_up_proj.dtype, module.gate_up_proj.device
        gate_up, down = [], []
        for gate_name, up_name, down_name in names:
            pair = [kept[gate_name], kept[up_name]]
            merged = RowShards(pair, max(w.bits for w in pair), min(w.group_size for w in pair))
            gate_up.append(select_kernel(merged, device, dtype, module.ops, arena=module.weight_arena))
            down.append(select_kernel(kept[down_name], device, dtype, module.ops, arena=module.weight_arena))
        del module.gate_up_proj, module.down_proj
        module.kept = KeptExperts(gate_up, down)
        taken.update(name for expert in names for name in expert)
    if taken:
        logger.info("%d experts' weights kept quantized (%s kernels)", len(taken), gate_up[0].name)
    return taken
