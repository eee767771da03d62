"""The float format: the checkpoint's weight [N, K] as it is (float32, or a GGUF file's F16 and BF16 matrices kept
in their 16 bits), every Linear's format until a quantized one is set.

Its kernel multiplies by the layer's own weight Parameter (shared, not copied: loading, the quantization tools'
in-place edits and the move into huge pages are all seen): F.linear, or on the CPU the C++ GEMV for a few rows and
oneDNN on a packed copy of the weight above them, a 16-bit weight the half GEMV (kernels/cpu/dense_gemv.py's
dense_linear; `use_dense_gemv` turns the CPU paths on at the end of a load).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kvforge.kernels.cpu.bf16_gemm import bf16_linear
from kvforge.kernels.cpu.dense_gemv import DENSE_GEMV_MAX_TOKENS, dense_linear, onednn_linear_fused
from kvforge.layers.linear_kernel import KernelModule

if TYPE_CHECKING:
    from kvforge.layers.linear import Linear


class FloatKernel(KernelModule):
    """y = x W^T + b with the float weight as stored."""

    name = "float"

    def __init__(self) -> None:
        super().__init__()
        self.register_parameter("weight", None)
        self.dense_gemv = False  # the rows through the CPU GEMV and oneDNN (set at load by use_dense_gemv)
        self.onednn_weight: torch.Tensor | None = None  # the weight packed for oneDNN (set with dense_gemv)
        # the weight rounded to bfloat16 and packed for kernels/cpu/bf16_gemm.py (set at load by use_bf16_matmuls)
        self.bf16_weight: torch.Tensor | None = None

    def prepare(self, weights: nn.Parameter) -> None:
        self.weight = weights

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if self._bf16_rows(x):
            return bf16_linear(x, self.bf16_weight, self.bias)
        return dense_linear(x, self.weight, self.bias, self.dense_gemv, self.onednn_weight)

    def apply_fused(self, x: torch.Tensor, activation: str) -> torch.Tensor | None:
        """activation(apply(x)) in one oneDNN call, where oneDNN multiplies x's rows (float32, more than the GEMV's,
        eager), or where the layer multiplies with bfloat16 products; None elsewhere."""
        if self._bf16_rows(x):
            return bf16_linear(x, self.bf16_weight, self.bias, activation)
        if (self.onednn_weight is None or x.dim() != 2 or x.dtype != torch.float32
                or x.shape[0] <= DENSE_GEMV_MAX_TOKENS or torch.compiler.is_dynamo_compiling()):
            return None
        return onednn_linear_fused(x, self.onednn_weight, self.bias, activation)

    def _bf16_rows(self, x: torch.Tensor) -> bool:
        """x [num_tokens, in_features] goes through the bfloat16-product kernel: the layer has its packed weight
        (the engine's bf16_matmuls option) and x is float32 rows of unit stride."""
        return self.bf16_weight is not None and x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1


class FloatFormat:
    """The checkpoint's float weight, loaded row-wise by the layer itself."""

    def create_weights(self, layer: Linear) -> None:
        pass

    def load_shard(self, layer: Linear, param_name: str, shard: int, tensor: torch.Tensor) -> bool:
        return False

    def checkpoint_axes(self, param_name: str) -> tuple[int | None, int | None] | None:
        return None

    def prepare_kernel(self, layer: Linear) -> FloatKernel:
        kernel = FloatKernel()
        kernel.prepare(layer.weight)
        kernel.bind(layer.out_features, layer.in_features, layer.bias)
        return kernel
