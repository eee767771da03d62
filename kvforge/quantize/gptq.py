"""GPTQ (Frantar et al., 2022): quantize a weight column by column, and push each column's rounding
error onto the columns not yet quantized, weighted by the inverse Hessian of the layer's inputs.

    H = 2 X^T X / num_tokens            (X: calibration inputs of the layer, [num_tokens, K]; float64 sums)
    U = chol((H + damp * mean(diag H) I)^-1), upper
    for each column k (in act order: by decreasing H[k, k] when act_order):
        q_k = round(w_k)                 with its group's scale and zero point
        e_k = (w_k - q_k) / U[k, k]
        w_j -= e_k U[k, j]   for j > k   (lazily: within a block of BLOCK columns at once, then
                                          one matrix product for every column after the block)

Groups are static: each group's scale and zero point come from the weights before any update, and a
group is always the same input features [g * group_size, (g + 1) * group_size) in the original order.
So act order changes only the order in which columns are rounded (the point of it: the columns with the
largest inputs go first, while there is still slack to absorb their error), and the checkpoint needs
no permutation (g_idx is the identity grouping), which the runtime kernels read fastest.
"""

from __future__ import annotations

import torch

from kvforge.quantization.quantized_weight import QuantizedWeight, group_params

BLOCK = 128  # columns updated together (lazy batch updates)
DAMP_TRIES = 6  # each failed Cholesky multiplies the dampening by 10


def inverse_hessian_factor(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) I)^-1 (float64 inside, float32 out).

    A Hessian that is not positive definite even after dampening (too few calibration tokens for
    the width) gets ten times the dampening, up to DAMP_TRIES times, before a ValueError."""
    hessian = hessian.double()
    diag = torch.arange(hessian.shape[0])
    mean_diag = torch.mean(torch.diag(hessian)).item()
    for attempt in range(DAMP_TRIES):
        damped = hessian.clone()
        damped[diag, diag] += damp * 10**attempt * mean_diag
        lower, info = torch.linalg.cholesky_ex(damped)
        if info.item() == 0:
            inverse = torch.cholesky_inverse(lower)
            factor, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if info.item() == 0:
                return factor.float()
    raise ValueError(
        f"the Hessian of width {hessian.shape[0]} is not positive definite even with dampening "
        f"{damp * 10 ** (DAMP_TRIES - 1)}: more calibration tokens are needed"
    )


def static_group_params(
    weight: torch.Tensor, bits: int, group_size: int, sym: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and zero points [N, G] of each group of the weight as it is, before GPTQ's updates."""
    groups = weight.reshape(weight.shape[0], -1, group_size).transpose(0, 1)  # [G, N, g]
    params = [group_params(group, bits, sym) for group in groups]
    return torch.stack([s for s, _ in params], dim=1), torch.stack([z for _, z in params], dim=1)


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    bits: int,
    group_size: int,
    sym: bool,
    act_order: bool,
    damp: float = 0.01,
) -> QuantizedWeight:
    """weight: [N, K] float, hessian: [K, K] -> the QuantizedWeight (input features in original order)."""
    weight = weight.float().clone()
    hessian = hessian.double().clone()
    num_rows, in_features = weight.shape
    group_size = in_features if group_size == -1 else group_size
    if in_features % group_size:
        raise ValueError(f"input width {in_features} is not a multiple of group_size {group_size}")
    dead = torch.diag(hessian) == 0  # inputs never seen in calibration
    hessian[dead, dead] = 1
    weight[:, dead] = 0
    scales, zeros = static_group_params(weight, bits, group_size, sym)
    group_of = torch.arange(in_features) // group_size
    order = torch.argsort(torch.diag(hessian), descending=True) if act_order else torch.arange(in_features)
    weight, hessian = weight[:, order], hessian[order][:, order]
    column_scales, column_zeros = scales[:, group_of[order]], zeros[:, group_of[order]]  # [N, K] each
    factor = inverse_hessian_factor(hessian, damp)
    codes = _quantize_columns(weight, factor, column_scales, column_zeros, bits)
    restored = torch.empty_like(codes)
    restored[:, order] = codes
    return QuantizedWeight(restored.to(torch.uint8), scales, zeros, bits)


def _quantize_columns(
    weight: torch.Tensor, factor: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int
) -> torch.Tensor:
    """GPTQ's loop over columns in their (already permuted) order; weight is updated in place."""
    max_code = 2**bits - 1
    in_features = weight.shape[1]
    codes = torch.empty_like(weight)
    inverse_diag = 1 / torch.diag(factor)
    for start in range(0, in_features, BLOCK):
        end = min(start + BLOCK, in_features)
        block = weight[:, start:end]  # a view: updates land in weight
        block_factor = factor[start:end, start:end]
        errors = torch.empty_like(block)
        for i in range(end - start):
            column = block[:, i]
            scale, zero = scales[:, start + i], zeros[:, start + i]
            code = torch.clamp(torch.round(column / scale) + zero, 0, max_code)
            codes[:, start + i] = code
            error = (column - (code - zero) * scale) * inverse_diag[start + i]
            block[:, i + 1 :].sub_(error[:, None] * block_factor[i, i + 1 :][None, :])
            errors[:, i] = error
        weight[:, end:].sub_(errors @ factor[start:end, end:])
    return codes
