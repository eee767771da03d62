"""The interface between Linear and a quantization method, and the weight-only (W4A16, W8A16) runtime.

A method owns a Linear's weight from construction to matmul:

    create_weights(layer)                 register parameters in the checkpoint's layout
    load_shard(layer, name, shard, t)     fill one shard of a (merged) layer; False: Linear's float path
    process_weights_after_loading(layer)  convert to the runtime layout, drop the checkpoint tensors
    apply(layer, x)                       y = x W^T + b

Weight-only methods end in the same runtime whatever the checkpoint format: a QuantizedWeight handed
to `install_weight_only`, which picks the fastest kernel object for the layer's device once
(quantization/weight_only_kernels.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvforge.kernels.ops import current_ops
from kvforge.quantization.quantized_weight import QuantizedWeight, RowShards, quantize_rtn
from kvforge.quantization.weight_only_kernels import select_kernel

if TYPE_CHECKING:
    from kvforge.layers.linear import Linear


class LinearMethod:
    """Base of every quantization method; the float weight path is Linear's own."""

    def create_weights(self, layer: Linear) -> None:
        """Replace the float weight with the checkpoint's tensors (default: keep the float weight)."""

    def load_shard(self, layer: Linear, param_name: str, shard: int, tensor: torch.Tensor) -> bool:
        """Load a tensor this method owns; False hands it to Linear's float loading."""
        return False

    def checkpoint_axes(self, param_name: str) -> tuple[int | None, int | None] | None:
        """(output-feature axis, input-feature axis) of a checkpoint tensor, for tensor-parallel
        slicing; None: laid out like the float weight ([N, K]) or a per-output vector ([N])."""
        return None

    def process_weights_after_loading(self, layer: Linear) -> None:
        raise NotImplementedError

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class WeightOnlyMethod(LinearMethod):
    """Weights quantized, activations in float: subclasses turn their tensors into a QuantizedWeight."""

    def to_quantized_weight(self, layer: Linear) -> QuantizedWeight | RowShards:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: Linear) -> None:
        install_weight_only(layer, self.to_quantized_weight(layer))

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [num_tokens, in_features]
        if layer.w_perm is not None:
            rows = rows[:, layer.w_perm]
        out = layer.kernel.apply(rows)
        if layer.bias is not None:
            out = out + layer.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


class RTNMethod(WeightOnlyMethod):
    """Round-to-nearest of a float checkpoint at load time (the `quantization=` engine option). A layer whose
    input width is not a multiple of the group size gets one group per row."""

    def __init__(self, bits: int, group_size: int, sym: bool) -> None:
        self.bits, self.group_size, self.sym = bits, group_size, sym

    def to_quantized_weight(self, layer: Linear) -> QuantizedWeight:
        in_features = layer.weight.shape[1]
        group_size = self.group_size if self.group_size > 0 and in_features % self.group_size == 0 else -1
        return quantize_rtn(layer.weight.data, self.bits, group_size, self.sym)


def drop_parameters(layer: Linear, *names: str) -> None:
    for name in names:
        delattr(layer, name)


def install_weight_only(layer: Linear, weight: QuantizedWeight | RowShards) -> None:
    """Store weight in the layout of the fastest kernel for the layer's device, drop the float weight."""
    device, dtype = layer.param_device, layer.param_dtype
    drop_parameters(layer, *[name for name, _ in layer.named_parameters(recurse=False) if name != "bias"])
    perm = weight.perm if isinstance(weight, QuantizedWeight) else None  # a merged layer's shards: input order
    layer.register_buffer("w_perm", None if perm is None else perm.to(device), persistent=False)
    layer.kernel = select_kernel(weight, device, dtype, current_ops(), arena=layer.weight_arena)
