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

from kvforge.kernels.int8_gemm import INT8_MAX, quantize_per_token_ref
from kvforge.kernels.ops import current_ops
from kvforge.quantization import cpu_gemm
from kvforge.quantization.linear_method import LinearMethod, drop_parameters

if TYPE_CHECKING:
    from kvforge.layers.linear import Linear


def quantize_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (codes [N, K] int8, scales [N] float32), symmetric per row."""
    scales = (weight.float().abs().amax(dim=1).clamp(min=1e-8) / INT8_MAX).half().float()
    codes = torch.round(weight.float() / scales[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scales


class W8A8Method(LinearMethod):
    """from_float: quantize a float checkpoint at load time; otherwise load the int8 checkpoint tensors."""

    def __init__(self, from_float: bool, smoothquant: bool = False) -> None:
        self.from_float, self.smoothquant = from_float, smoothquant

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

    def process_weights_after_loading(self, layer: Linear) -> None:
        if self.from_float:
            codes, scales = quantize_weight_int8(layer.weight.data)
            inv_smooth = None
        else:
            codes, scales = layer.weight.data, layer.weight_scale.data.float()
            inv_smooth = 1.0 / layer.smooth_factor.data.float() if self.smoothquant else None
        drop_parameters(layer, *[n for n, _ in layer.named_parameters(recurse=False) if n != "bias"])
        layer.register_buffer("w_codes", codes.contiguous(), persistent=False)
        layer.register_buffer("w_scales", scales.contiguous(), persistent=False)
        layer.register_buffer(
            "inv_smooth", None if inv_smooth is None else inv_smooth.to(layer.param_dtype), persistent=False
        )
        ops = current_ops()
        layer.quant_kernel = "cpu" if layer.param_device.type == "cpu" and ops.backend == "torch" else "int8"
        layer.int8_gemm = ops.int8_gemm

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [num_tokens, in_features]
        if layer.inv_smooth is not None:
            rows = rows * layer.inv_smooth
        codes, token_scales = quantize_per_token_ref(rows)  # [M, K] int8, [M]
        if layer.quant_kernel == "int8":
            out = layer.int8_gemm(codes, layer.w_codes, token_scales, layer.w_scales, x.dtype)
        else:
            out = _cpu_int8_gemm(codes, layer.w_codes, token_scales, layer.w_scales).to(x.dtype)
        if layer.bias is not None:
            out = out + layer.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


def _cpu_int8_gemm(
    codes: torch.Tensor, weight: torch.Tensor, token_scales: torch.Tensor, weight_scales: torch.Tensor
) -> torch.Tensor:
    """int8 x int8 on the CPU, where torch._int_mm is slower than float GEMMs (measured 14-50 ms at
    M=64 for the default model's shapes, against 0.5-1.8 ms for fp32 F.linear).

    NOTE: int8 codes are exact in bfloat16 and float32, so int8pack (bf16 activations) and F.linear
    on the codes compute the integer dot products; only the rescale rounds."""
    if codes.shape[0] <= cpu_gemm.INT8PACK_MAX_TOKENS and hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        out = torch.ops.aten._weight_int8pack_mm(
            codes.to(torch.bfloat16), weight, weight_scales.to(torch.bfloat16)
        )
        return out.float() * token_scales[:, None]
    return F.linear(codes.float(), weight.float()) * token_scales[:, None] * weight_scales
