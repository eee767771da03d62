"""LayerNorm, with the residual add fused in when a residual is passed: the post-norm encoders' norm
(models/bert.py). The reference is torch's layer_norm; on the CPU the C++ kernel of csrc/layer_norm.cpp reads each
row once (kernels/cpu/layer_ops.py: layer_norm_cpu). On GPUs the reference is what torch.compile fuses."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
    """LayerNorm(x + residual) over the last dimension, or LayerNorm(x) without a residual.  x: [num_tokens, hidden];
    weight, bias: [hidden]."""
    row = x if residual is None else x + residual
    return F.layer_norm(row, (row.shape[-1],), weight, bias, eps)
