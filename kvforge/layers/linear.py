"""Linear layers, including the merged ones (QKV, gate-up) that load several checkpoint tensors."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from kvforge.quantization.linear_method import LinearMethod


class Linear(nn.Module):
    """y = x W^T + b. Merged layers stack several checkpoint matrices along the output dimension;
    `shard_sizes` names the row count of each, and `load_shard` fills one of them.

    A quantized layer hands its weight to a LinearMethod (`set_quant_method`), which creates, loads and
    multiplies it; the float path stays a plain F.linear."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.shard_sizes = shard_sizes
        self.shard_offsets = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]
        self.out_features = sum(shard_sizes)
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(self.out_features), requires_grad=False) if bias else None
        self.quant_method: LinearMethod | None = None

    def set_quant_method(self, method: LinearMethod) -> None:
        """Before loading: let method replace the float weight with its own tensors."""
        self.param_dtype, self.param_device = self.weight.dtype, self.weight.device
        self.quant_method = method
        method.create_weights(self)

    def load_shard(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        if self.quant_method is not None and self.quant_method.load_shard(self, param_name, shard, tensor):
            return
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
        if self.quant_method is None:
            return F.linear(x, self.weight, self.bias)
        return self.quant_method.apply(self, x)
