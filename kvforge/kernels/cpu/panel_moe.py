"""Routed experts packed for the panel kernel (a GGUF file's experts kept in their blocks,
quantization/kept_experts.py) as one custom op, `kvforge::panel_moe`: kernels/fused_moe.py's fused_moe_per_expert
with each expert's gate/up and down products made by panel_linear.

    hidden [T, hidden], topk_weights and topk_ids [T, top_k]
    gate_up[e]  expert e's [gate | up] rows in the panel layout (factor gate_up_factors[e], gate_up_bits-bit codes,
                gate_up_features rows), down[e] its down projection (down_factors[e], down_bits, hidden rows)

Gathering each expert's tokens needs its token count on the host, which torch.compile cannot trace; as an opaque op
(its fake gives the output's shape) the experts run inside a compiled decode step rather than keeping the whole step
eager.
"""

from __future__ import annotations

import functools

import torch

from kvforge.kernels.cpu.quant_panels import panel_linear
from kvforge.kernels.fused_moe import fused_moe_per_expert

Tensor = torch.Tensor


@torch.library.custom_op("kvforge::panel_moe", mutates_args=())
def panel_moe(
    hidden: Tensor, topk_weights: Tensor, topk_ids: Tensor, gate_up: list[Tensor], down: list[Tensor],
    gate_up_factors: list[float], down_factors: list[float], gate_up_bits: int, down_bits: int,
    gate_up_features: int,
) -> Tensor:  # fmt: skip
    """The MoE of the panel-packed experts (the module docstring): [T, hidden] in hidden's dtype."""
    gate_up_products = [functools.partial(panel_linear, weight=w, factor=f, bits=gate_up_bits,
                                          out_features=gate_up_features) for w, f in zip(gate_up, gate_up_factors)]
    down_products = [functools.partial(panel_linear, weight=w, factor=f, bits=down_bits, out_features=hidden.shape[1])
                     for w, f in zip(down, down_factors)]  # fmt: skip
    return fused_moe_per_expert(hidden, topk_weights, topk_ids, gate_up_products, down_products)


@panel_moe.register_fake
def _(
    hidden: Tensor, topk_weights: Tensor, topk_ids: Tensor, gate_up: list[Tensor], down: list[Tensor],
    gate_up_factors: list[float], down_factors: list[float], gate_up_bits: int, down_bits: int,
    gate_up_features: int,
) -> Tensor:  # fmt: skip
    return hidden.new_empty(hidden.shape)
