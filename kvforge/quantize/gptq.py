"""GPTQ (Frantar et al., 2022): quantize a weight column by column, and push each column's rounding
error onto the columns not yet quantized, weighted by the inverse Hessian of the layer's inputs.

    H = 2 X^T X / num_tokens            (X: calibration inputs of the layer, [num_tokens, K])
    for each column k (in act order: by decreasing H[k, k] when act_order):
        q_k = round(w_k)                 with its group's scale and zero point
        e_k = (w_k - q_k) / U[k, k]      U: upper Cholesky factor of H^-1
        w_j -= e_k U[k, j]   for j > k
"""

from __future__ import annotations

import torch

from kvforge.quantization.quantized_weight import QuantizedWeight, group_params, quantize_codes

BLOCK = 128  # columns updated together (lazy batch updates)


def inverse_hessian_factor(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) I)^-1."""
    damped = hessian.clone()
    diag = torch.arange(damped.shape[0])
    damped[diag, diag] += damp * torch.mean(torch.diag(damped))
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(damped))
    return torch.linalg.cholesky(inverse, upper=True)


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    bits: int,
    group_size: int,
    sym: bool,
    act_order: bool,
    damp: float = 0.01,
) -> QuantizedWeight:
    """weight: [N, K] float, hessian: [K, K] -> the QuantizedWeight (perm set when act_order)."""
    weight = weight.float().clone()
    hessian = hessian.float().clone()
    num_rows, in_features = weight.shape
    group_size = in_features if group_size == -1 else group_size
    if in_features % group_size:
        raise ValueError(f"input width {in_features} is not a multiple of group_size {group_size}")
    dead = torch.diag(hessian) == 0  # inputs never seen in calibration
    hessian[dead, dead] = 1
    weight[:, dead] = 0
    perm = torch.argsort(torch.diag(hessian), descending=True) if act_order else None
    if perm is not None:
        weight, hessian = weight[:, perm], hessian[perm][:, perm]
    factor = inverse_hessian_factor(hessian, damp)
    codes = torch.zeros_like(weight)
    scales = torch.zeros(num_rows, in_features // group_size)
    zeros = torch.zeros_like(scales)
    for start in range(0, in_features, BLOCK):
        end = min(start + BLOCK, in_features)
        block = weight[:, start:end].clone()
        errors = torch.zeros_like(block)
        for i in range(end - start):
            column = start + i
            if column % group_size == 0:
                group = column // group_size
                scales[:, group], zeros[:, group] = group_params(
                    weight_group(weight, block, start, column, group_size), bits, sym
                )
            scale, zero = scales[:, column // group_size], zeros[:, column // group_size]
            code = quantize_codes(block[:, i : i + 1], scale, zero, bits)[:, 0]
            codes[:, column] = code
            error = (block[:, i] - (code - zero) * scale) / factor[column, column]
            block[:, i:] -= error[:, None] * factor[column, start + i : end][None, :]
            errors[:, i] = error
        weight[:, end:] -= errors @ factor[start:end, end:]
    return QuantizedWeight(codes.to(torch.uint8), scales, zeros, bits, perm)


def weight_group(
    weight: torch.Tensor, block: torch.Tensor, block_start: int, column: int, group_size: int
) -> torch.Tensor:
    """The current values of columns [column, column + group_size): updated ones from block, the rest
    from weight (GPTQ picks a group's scale when it reaches the group's first column)."""
    block_end = block_start + block.shape[1]
    group_end = column + group_size
    inside = block[:, column - block_start : min(group_end, block_end) - block_start]
    if group_end <= block_end:
        return inside
    return torch.cat([inside, weight[:, block_end:group_end]], dim=1)
