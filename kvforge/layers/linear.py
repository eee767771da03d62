"""Linear layers, including the merged ones (QKV, gate-up) that load several checkpoint tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T + b. Merged layers stack several checkpoint matrices along the output dimension;
    `shard_sizes` names the row count of each, and `load_shard` fills one of them."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        self.shard_sizes = shard_sizes
        self.shard_offsets = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]
        out_features = sum(shard_sizes)
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def load_shard(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        param = getattr(self, param_name)
        if param is None:
            raise ValueError(f"checkpoint has a {param_name} that this layer does not use")
        start, size = self.shard_offsets[shard], self.shard_sizes[shard]
        if tensor.shape[0] != size or tensor.shape[1:] != param.shape[1:]:
            raise ValueError(
                f"checkpoint tensor of shape {tuple(tensor.shape)} does not fit shard {shard} "
                f"of shape {(size, *param.shape[1:])}"
            )
        param.data[start : start + size].copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
