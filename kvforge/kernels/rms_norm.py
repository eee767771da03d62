"""RMSNorm, optionally fused with the residual add."""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """out = x / sqrt(mean(x^2) + eps) * weight, computed in fp32.  x: [num_tokens, hidden]."""
    x32 = x.float()
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    return (x32 * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual')."""
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps), new_residual
