"""AWQ (Lin et al., 2023): scale up the input channels that carry large activations before rounding,
and fold the inverse scale into the operation that produces those inputs, so the float function is
unchanged while the salient weights lose less precision.

    s = mean|x|^alpha (normalized), alpha searched on a grid to minimize || Q(W s) (X / s)^T - W X^T ||
    W <- W diag(s),   previous op's output <- output / s

Fold targets in a Llama-style decoder layer:
    qkv_proj <- input_layernorm weight        gate_up_proj <- post_attention_layernorm weight
    down_proj <- the up half of gate_up_proj  o_proj: left alone when GQA makes v narrower than o's input
"""

from __future__ import annotations

import torch
from torch import nn

from kvforge.quantization.quantized_weight import quantize_rtn
from kvforge.quantize.calibration import InputStats

GRID = 20


def search_scales(weight: torch.Tensor, stats: InputStats, bits: int, group_size: int) -> torch.Tensor:
    """The per-input-feature scale s [K] with the least output error on the sampled inputs."""
    rows = stats.sampled_rows()  # [num_rows, K]
    reference = rows @ weight.t()
    mean_abs = (stats.abs_sum / max(stats.num_tokens, 1)).clamp(min=1e-4)
    best_error, best_scales = float("inf"), torch.ones_like(mean_abs)
    for step in range(GRID):
        scales = mean_abs.pow(step / GRID)
        scales = scales / (scales.max() * scales.min()).sqrt()
        quantized = quantize_rtn(weight * scales, bits, group_size, sym=False).dequantize() / scales
        error = (rows @ quantized.t() - reference).pow(2).mean().item()
        if error < best_error:
            best_error, best_scales = error, scales
    return best_scales


def apply_awq_scales(
    decoder_layer: nn.Module, stats: dict[str, InputStats], prefix: str, bits: int, group_size: int
) -> None:
    """Search and fold the scales of one decoder layer in place (weights stay float)."""
    attn, mlp = decoder_layer.self_attn, decoder_layer.mlp
    with torch.no_grad():
        qkv = attn.qkv_proj.weight
        scales = search_scales(qkv.data, stats[f"{prefix}.self_attn.qkv_proj"], bits, group_size)
        qkv.mul_(scales[None, :])
        decoder_layer.input_layernorm.weight.div_(scales)
        gate_up = mlp.gate_up_proj.weight
        scales = search_scales(gate_up.data, stats[f"{prefix}.mlp.gate_up_proj"], bits, group_size)
        gate_up.mul_(scales[None, :])
        decoder_layer.post_attention_layernorm.weight.div_(scales)
        down = mlp.down_proj.weight
        scales = search_scales(down.data, stats[f"{prefix}.mlp.down_proj"], bits, group_size)
        down.mul_(scales[None, :])
        up_start = mlp.gate_up_proj.shard_offsets[1]
        gate_up[up_start:].div_(scales[:, None])
        if attn.kv_size == attn.q_size:  # o_proj's input is v's output, head by head
            o_proj = attn.o_proj.weight
            scales = search_scales(o_proj.data, stats[f"{prefix}.self_attn.o_proj"], bits, group_size)
            o_proj.mul_(scales[None, :])
            v_start = attn.qkv_proj.shard_offsets[2]
            qkv[v_start:].div_(scales[:, None])
            if attn.qkv_proj.bias is not None:
                attn.qkv_proj.bias[v_start:].div_(scales)
