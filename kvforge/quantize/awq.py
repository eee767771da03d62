"""AWQ (Lin et al., 2023): scale up the input channels that carry large activations before rounding,
fold the inverse scale into the operation that produces those inputs (so the float function is
unchanged while the salient weights lose less precision), then clip each group's weight range to the
value that minimizes the output error.

    scale search, per linear layer, on its sampled calibration inputs X [n, K]:
        s = mean|x|^a / mean_w^(1 - a)  (mean_w: |W| over its group's max, averaged over output rows),
            normalized by sqrt(max s * min s); a on a grid of GRID points in [0, 1)
        a* = argmin || Q(W diag(s)) (X / s)^T - W X^T ||^2
        W <- W diag(s),   the previous op's output <- output / s
    clip search, per output row and group: max |W| shrunk by r on a grid in [1, 1 - CLIP_SHRINK],
        r* = argmin of that group's output error || (Q(clip(W, r)) - W) X^T ||^2

The layer pairs (AWQ's): qkv_proj <- input_layernorm, gate_up_proj <- post_attention_layernorm,
down_proj <- the up half of gate_up_proj, o_proj <- the v rows of qkv_proj (only without GQA, where
o's input features are v's outputs one to one). q and k are not clipped (their outputs only meet in the
attention scores, which the per-layer error does not see); v, o, gate, up and down are.
"""

from __future__ import annotations

import torch
from torch import nn

from kvforge.quantization.quantized_weight import quantize_rtn
from kvforge.quantize.calibration import InputStats

GRID = 20
CLIP_SHRINK = 0.5  # the most a group's range is shrunk
CLIP_ROWS = 512  # sampled inputs used by the clip search
ROW_CHUNK = 256  # output rows per step of the clip search (bounds its memory)


def _fake_quantize(weight: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    return quantize_rtn(weight, bits, group_size, sym=False).dequantize()


def search_scales(weight: torch.Tensor, stats: InputStats, bits: int, group_size: int) -> torch.Tensor:
    """The per-input-feature scale s [K] with the least output error on the sampled inputs."""
    rows = stats.sampled_rows()  # [num_rows, K]
    reference = rows @ weight.t()
    x_mean = stats.mean_abs().clamp(min=1e-6)
    width = weight.shape[1] if group_size == -1 else group_size
    grouped = weight.abs().reshape(weight.shape[0], -1, width)
    w_mean = (grouped / grouped.amax(dim=2, keepdim=True).clamp(min=1e-6)).reshape_as(weight).mean(dim=0)
    best_error, best_scales = float("inf"), torch.ones_like(x_mean)
    for step in range(GRID):
        ratio = step / GRID
        scales = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
        scales = scales / (scales.max() * scales.min()).sqrt()
        quantized = _fake_quantize(weight * scales, bits, group_size) / scales
        error = (rows @ quantized.t() - reference).pow(2).mean().item()
        if error < best_error:
            best_error, best_scales = error, scales
    return best_scales


def clip_weight(weight: torch.Tensor, rows: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """weight [N, K] clipped, per output row and group, to the range with the least output error."""
    num_rows, in_features = weight.shape
    width = in_features if group_size == -1 else group_size
    x = rows[:CLIP_ROWS].reshape(-1, in_features // width, width)  # [n, G, g]
    clipped = []
    for start in range(0, num_rows, ROW_CHUNK):
        w = weight[start : start + ROW_CHUNK].reshape(-1, in_features // width, width)  # [r, G, g]
        reference = torch.einsum("ngk,rgk->rgn", x, w)
        max_abs = w.abs().amax(dim=2, keepdim=True)  # [r, G, 1]
        best_error = torch.full(max_abs.shape, float("inf"))
        best_max = max_abs.clone()
        for step in range(GRID):
            limit = max_abs * (1 - CLIP_SHRINK * step / GRID)
            candidate = torch.clamp(w, -limit, limit).reshape(w.shape[0], -1)
            quantized = _fake_quantize(candidate, bits, group_size).reshape_as(w)
            error = (torch.einsum("ngk,rgk->rgn", x, quantized) - reference).pow(2).mean(dim=2, keepdim=True)
            better = error < best_error
            best_error = torch.where(better, error, best_error)
            best_max = torch.where(better, limit, best_max)
        clipped.append(torch.clamp(w, -best_max, best_max).reshape(w.shape[0], -1))
    return torch.cat(clipped)


def _scale_pair(linear: nn.Module, stats: InputStats, bits: int, group_size: int) -> torch.Tensor:
    """Search linear's scales, multiply them into its weight and into its recorded inputs' inverse."""
    scales = search_scales(linear.weight.data, stats, bits, group_size)
    linear.weight.mul_(scales[None, :])
    stats.rows = [rows / scales for rows in stats.rows]
    return scales


def apply_awq(
    decoder_layer: nn.Module, stats: dict[str, InputStats], bits: int, group_size: int
) -> None:
    """Search and fold the scales of one decoder layer, then clip its weights (in place, still float).

    stats: by the linear's name inside the decoder layer ("self_attn.qkv_proj", ...)."""
    attn, mlp = decoder_layer.self_attn, decoder_layer.mlp
    with torch.no_grad():
        scales = _scale_pair(attn.qkv_proj, stats["self_attn.qkv_proj"], bits, group_size)
        decoder_layer.input_layernorm.weight.div_(scales)
        scales = _scale_pair(mlp.gate_up_proj, stats["mlp.gate_up_proj"], bits, group_size)
        decoder_layer.post_attention_layernorm.weight.div_(scales)
        scales = _scale_pair(mlp.down_proj, stats["mlp.down_proj"], bits, group_size)
        up_start = mlp.gate_up_proj.shard_offsets[1]
        mlp.gate_up_proj.weight[up_start:].div_(scales[:, None])
        if attn.kv_size == attn.q_size:  # o_proj's input is v's output, head by head
            scales = _scale_pair(attn.o_proj, stats["self_attn.o_proj"], bits, group_size)
            v_start = attn.qkv_proj.shard_offsets[2]
            attn.qkv_proj.weight[v_start:].div_(scales[:, None])
            if attn.qkv_proj.bias is not None:
                attn.qkv_proj.bias[v_start:].div_(scales)
        for name, linear, first_row in (("self_attn.qkv_proj", attn.qkv_proj, attn.qkv_proj.shard_offsets[2]),
                                        ("self_attn.o_proj", attn.o_proj, 0), ("mlp.gate_up_proj", mlp.gate_up_proj, 0),
                                        ("mlp.down_proj", mlp.down_proj, 0)):  # fmt: skip
            weight = linear.weight.data
            weight[first_row:] = clip_weight(weight[first_row:], stats[name].sampled_rows(), bits, group_size)
