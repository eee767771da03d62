"""The base of the quantized formats (layers/linear_kernel.py's LinearFormat), and the weight-only (W4A16, W8A16)
ones' way to their kernel.

A format owns a Linear's weight from construction to its kernel:

    create_weights(layer)                 register parameters in the checkpoint's layout
    load_shard(layer, name, shard, t)     fill one shard of a (merged) layer; False: the layer's row-wise copy
    prepare_kernel(layer)                 the kernel prepared from the loaded tensors, which are dropped

Weight-only formats end in the same runtime whatever the checkpoint format: a QuantizedWeight handed to
`select_kernel`, which picks the fastest kernel object for the layer's device once
(quantization/weight_only_kernels.py; a merged layer's shards of different widths get one per run of them,
quantization/shard_runs.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvforge.kernels.ops import current_ops
from kvforge.quantization.quantized_weight import QuantizedWeight, RowShards, quantize_rtn
from kvforge.quantization.shard_runs import ShardRunsKernel, select_merged_kernel
from kvforge.quantization.weight_only_kernels import WeightOnlyKernel

if TYPE_CHECKING:
    from kvforge.layers.linear import Linear
    from kvforge.layers.linear_kernel import LinearKernel
    from kvforge.quantization.config import QuantConfig


class LinearMethod:
    """Base of every quantized format; the float one is layers/float_linear.py."""

    def create_weights(self, layer: Linear) -> None:
        """Replace the float weight with the checkpoint's tensors (default: keep the float weight)."""

    def load_shard(self, layer: Linear, param_name: str, shard: int, tensor: torch.Tensor) -> bool:
        """Load a tensor this format owns; False hands it to the layer's row-wise copy."""
        return False

    def checkpoint_axes(self, param_name: str) -> tuple[int | None, int | None] | None:
        """(output-feature axis, input-feature axis) of a checkpoint tensor, for tensor-parallel
        slicing; None: laid out like the float weight ([N, K]) or a per-output vector ([N])."""
        return None

    def prepare_kernel(self, layer: Linear) -> LinearKernel:
        raise NotImplementedError


class WeightOnlyMethod(LinearMethod):
    """Weights quantized, activations in float: subclasses turn their tensors into a QuantizedWeight."""

    def to_quantized_weight(self, layer: Linear) -> QuantizedWeight | RowShards:
        raise NotImplementedError

    def prepare_kernel(self, layer: Linear) -> WeightOnlyKernel | ShardRunsKernel:
        """The fastest kernel for the layer's device, holding the weight in its layout (a merged layer whose shards
        differ in width: one per run of them, quantization/shard_runs.py); the checkpoint's tensors are dropped."""
        weight = self.to_quantized_weight(layer)
        drop_parameters(layer, *[name for name, _ in layer.named_parameters(recurse=False) if name != "bias"])
        return select_merged_kernel(weight, layer.param_device, layer.param_dtype, current_ops(),
                                    arena=layer.weight_arena, bias=layer.bias)


class RTNMethod(WeightOnlyMethod):
    """Round-to-nearest of a float checkpoint at load time (the `quantization=` engine option). A layer whose
    input width is not a multiple of the group size gets one group per row."""

    def __init__(self, bits: int, group_size: int, sym: bool) -> None:
        self.bits, self.group_size, self.sym = bits, group_size, sym

    @classmethod
    def from_config(cls, config: QuantConfig, from_float: bool) -> RTNMethod:
        return cls(config.bits, config.group_size, config.sym)

    def to_quantized_weight(self, layer: Linear) -> QuantizedWeight:
        in_features = layer.weight.shape[1]
        group_size = self.group_size if self.group_size > 0 and in_features % self.group_size == 0 else -1
        return quantize_rtn(layer.weight.data, self.bits, group_size, self.sym)


def drop_parameters(layer: Linear, *names: str) -> None:
    for name in names:
        delattr(layer, name)
