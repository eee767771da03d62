"""W8A8: int8 weights (per output channel, symmetric) times int8 activations (per token, dynamic).

Checkpoint tensors of a W8A8 layer (kvforge's format, `quant_method: "w8a8"`):

    weight        [N, K] int8    codes
    weight_scale  [N]    float   W ~= weight * weight_scale[:, None]
    smooth_factor [K]    float   only with `smoothquant: true`: the layer computes (x / s) (W s)^T,
                                 which moves activation outliers into the weights (SmoothQuant)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvforge.kernels.cpu import packed_gemm
from kvforge.kernels.int8_gemm import INT8_MAX, quantize_per_token_ref
from kvforge.kernels.ops import OpTable, current_ops
from kvforge.layers.linear_kernel import KernelModule
from kvforge.quantization.linear_method import LinearMethod, drop_parameters

if TYPE_CHECKING:
    from kvforge.layers.linear import Linear
    from kvforge.quantization.config import QuantConfig


def quantize_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (codes [N, K] int8, scales [N] float32), symmetric per row."""
    scales = (weight.float().abs().amax(dim=1).clamp(min=1e-8) / INT8_MAX).half().float()
    codes = torch.round(weight.float() / scales[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scales


class W8A8Method(LinearMethod):
    """from_float: quantize a float checkpoint at load time; otherwise load the int8 checkpoint tensors."""

    def __init__(self, from_float: bool, smoothquant: bool = False) -> None:
        self.from_float, self.smoothquant = from_float, smoothquant

    @classmethod
    def from_config(cls, config: QuantConfig, from_float: bool) -> W8A8Method:
        return cls(from_float, config.smoothquant)

    def create_weights(self, layer: Linear) -> None:
        if self.from_float:
            return
        device = layer.param_device
        drop_parameters(layer, "weight")
        codes = torch.zeros(layer.out_features, layer.in_features, dtype=torch.int8, device=device)
        layer.register_parameter("weight", torch.nn.Parameter(codes, requires_grad=False))
        scales = torch.zeros(layer.out_features, dtype=torch.float32, device=device)
        layer.register_parameter("weight_scale", torch.nn.Parameter(scales, requires_grad=False))
        if self.smoothquant:
            smooth = torch.zeros(layer.in_features, dtype=torch.float32, device=device)
            layer.register_parameter("smooth_factor", torch.nn.Parameter(smooth, requires_grad=False))

    def checkpoint_axes(self, param_name: str) -> tuple[int | None, int | None] | None:
        return (None, 0) if param_name == "smooth_factor" else None

    def load_shard(self, layer: Linear, param_name: str, shard: int, tensor: torch.Tensor) -> bool:
        if self.from_float or param_name != "smooth_factor":
            return False  # weight and weight_scale are row-sharded like a float weight
        if tensor.shape != layer.smooth_factor.shape:
            raise ValueError(
                f"smooth_factor of shape {tuple(tensor.shape)}, expected {tuple(layer.smooth_factor.shape)}"
            )
        layer.smooth_factor.data.copy_(tensor)
        return True

    def prepare_kernel(self, layer: Linear) -> Int8Kernel:
        if self.from_float:
            codes, scales = quantize_weight_int8(layer.weight.data)
            inv_smooth = None
        else:
            codes, scales = layer.weight.data, layer.weight_scale.data.float()
            inv_smooth = 1.0 / layer.smooth_factor.data.float() if self.smoothquant else None
        drop_parameters(layer, *[n for n, _ in layer.named_parameters(recurse=False) if n != "bias"])
        ops = current_ops()
        on_cpu = layer.param_device.type == "cpu" and ops.backend == "torch"
        kernel = CpuInt8Kernel() if on_cpu else Int8GemmKernel(ops)
        kernel.prepare((codes, scales, None if inv_smooth is None else inv_smooth.to(layer.param_dtype)))
        kernel.bind(layer.out_features, layer.in_features, layer.bias)
        return kernel.to(layer.param_device)


class Int8Kernel(KernelModule):
    """Base: int8 weight codes and their per-row scales; apply(x) divides x by the smoothing factors (SmoothQuant),
    quantizes it per token and multiplies (`multiply`)."""

    def prepare(self, weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]) -> None:
        """weights: (codes [N, K] int8, scales [N] float32, 1 / smooth_factor [K] or None)."""
        codes, scales, inv_smooth = weights
        self.register_buffer("codes", codes.contiguous(), persistent=False)
        self.register_buffer("scales", scales.contiguous(), persistent=False)
        self.register_buffer("inv_smooth", inv_smooth, persistent=False)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if self.inv_smooth is not None:
            x = x * self.inv_smooth
        return self.biased(self.multiply(x))

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Int8GemmKernel(Int8Kernel):
    """The op table's int8 x int8 GEMM (Triton on GPUs)."""

    name = "int8"

    def __init__(self, ops: OpTable) -> None:
        super().__init__()
        self.int8_gemm = ops.int8_gemm

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        x_codes, token_scales = quantize_per_token_ref(x)  # [M, K] int8, [M]
        return self.int8_gemm(x_codes, self.codes, token_scales, self.scales, x.dtype)


class CpuInt8Kernel(Int8Kernel):
    """int8 x int8 on the CPU, where torch._int_mm is slower than float GEMMs (measured 14-50 ms at
    M=64 for the default model's shapes, against 0.5-1.8 ms for fp32 F.linear).

    NOTE: int8 codes are exact in bfloat16 and float32, so int8pack (bf16 activations) and F.linear
    on the codes compute the integer dot products; only the rescale rounds."""

    name = "cpu"

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        x_codes, token_scales = quantize_per_token_ref(x)
        if x_codes.shape[0] <= packed_gemm.INT8PACK_MAX_TOKENS and hasattr(torch.ops.aten, "_weight_int8pack_mm"):
            out = torch.ops.aten._weight_int8pack_mm(x_codes.to(torch.bfloat16), self.codes,
                                                     self.scales.to(torch.bfloat16))
            return (out.float() * token_scales[:, None]).to(x.dtype)
        out = F.linear(x_codes.float(), self.codes.float()) * token_scales[:, None] * self.scales
        return out.to(x.dtype)
