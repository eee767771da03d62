"""The one interface every linear layer runs through, whatever its weight format (float included).

    format   how a checkpoint stores a layer's weight: the tensors it loads in place of the float `weight`, how a
             tensor-parallel rank slices them, and which kernel it turns them into once they are all in
             (quantization/registry.py maps each format to its implementation; the float one is layers/float_linear.py)
    kernel   the weight in the layout one kernel streams best, and the multiply:

                 prepare(weights)    at load, once: the format's tensors -> the kernel's own (repacked once)
                 apply(x)            x [M, K] -> x W^T + b [M, N] in x's dtype
                 weight_bytes()      bytes a pass over the layer reads (codes, scales, bias), for the profiler
                 flops(num_rows)     floating-point operations of apply on num_rows rows, for the profiler

The layer (layers/linear.py) holds one format and, once loaded, one kernel; it never asks which format it has.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from kvforge.layers.linear import Linear


class LinearKernel(Protocol):
    """A linear layer's weight in one kernel's layout, and its multiply."""

    name: str

    def prepare(self, weights: Any) -> None:
        """Take the format's weights (each format's own kind: a float tensor, a QuantizedWeight, fp8 codes and
        scales, ...) into this kernel's layout."""
        ...

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> x W^T + b [M, N]."""
        ...

    def weight_bytes(self) -> int:
        """Bytes a pass over the layer reads: the weight as this kernel stores it (codes, scales), and the bias."""
        ...

    def flops(self, num_rows: int) -> int:
        """Floating-point operations of apply on num_rows rows of x."""
        ...


class LinearFormat(Protocol):
    """How a checkpoint format stores a Linear's weight, from construction to its kernel."""

    def create_weights(self, layer: Linear) -> None:
        """Before loading: replace the float weight with the checkpoint's tensors (the float format keeps it)."""
        ...

    def load_shard(self, layer: Linear, param_name: str, shard: int, tensor: torch.Tensor) -> bool:
        """Load a tensor this format owns; False hands it to the layer's row-wise copy."""
        ...

    def checkpoint_axes(self, param_name: str) -> tuple[int | None, int | None] | None:
        """(output-feature axis, input-feature axis) of a checkpoint tensor, for tensor-parallel slicing; None: laid
        out like the float weight ([N, K]) or a per-output vector ([N])."""
        ...

    def prepare_kernel(self, layer: Linear) -> LinearKernel:
        """Once every checkpoint tensor is in: the kernel, prepared from them (the layer's checkpoint tensors
        other than its bias are dropped where the kernel keeps its own copy)."""
        ...


class WeightArena(Protocol):
    """Where a kernel whose layout is interleaved by thread places its weight (quantization's PanelArena)."""

    def place(self, parts: int, part_bytes: int) -> torch.Tensor:
        """An unwritten uint8 [parts, part_bytes], part t where thread t reads it."""
        ...


class KernelModule(nn.Module):
    """A base for kernels: the shape, the layer's bias (added after the multiply), and the bytes and FLOPs the
    profiler reads. `bind` is called by the format when it prepares the kernel."""

    name = ""

    def __init__(self) -> None:
        super().__init__()
        self.out_features = self.in_features = 0
        self.register_parameter("bias", None)

    def bind(self, out_features: int, in_features: int, bias: nn.Parameter | None) -> None:
        """The layer's shape and bias (its own Parameter, shared: loading and in-place edits of it are seen)."""
        self.out_features, self.in_features = out_features, in_features
        self.bias = bias

    def biased(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.bias is None else out + self.bias

    def weight_bytes(self) -> int:
        """Every tensor the kernel holds (parameters and buffers), each once."""
        return sum(t.nbytes for t in (*self.parameters(), *self.buffers()))

    def flops(self, num_rows: int) -> int:
        return 2 * num_rows * self.out_features * self.in_features
