"""FP8 (e4m3) weights: one byte per weight and a float32 scale per output channel.

    W[n, k] ~= weight[n, k] * weight_scale[n]        weight [N, K] float8_e4m3fn, weight_scale [N] float32

Two sources:
- a float checkpoint with `quantization="fp8"`: weight_scale = max |W[n, :]| / 448 (e4m3's largest
  value), weight = W / weight_scale rounded to e4m3;
- an fp8 checkpoint (`quantization_config.quant_method: "fp8"`, as AutoFP8, llm-compressor and vLLM
  write it): each `weight_scale` is per tensor ([] or [1]) or per channel ([N] or [N, 1]); a per-tensor
  scale becomes the scale of each of its tensor's rows, so that the shards of a merged layer keep their
  own. Static activation scales (`input_scale`) are dropped: activations stay in float, or on fp8 GPUs
  are quantized per token as they come, which is at least as precise.

The matmul, where the device has fp8 math (Platform.has_native_fp8: CUDA sm_89+, ROCm gfx942/gfx950/gfx12): activations
are quantized to fp8 per token and torch._scaled_mm multiplies with fp32 accumulation,

    y[m, n] = (sum_k xq[m, k] * weight[n, k]) * x_scale[m] * weight_scale[n]

Elsewhere (the CPU, older GPUs) the weight is dequantized to the activation dtype and F.linear runs:
fp8 then saves memory, not time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvforge.kernels.ops import current_ops
from kvforge.layers.linear_kernel import KernelModule
from kvforge.platforms import Platform, current_platform
from kvforge.quantization.linear_method import LinearMethod, drop_parameters

if TYPE_CHECKING:
    from kvforge.layers.linear import Linear
    from kvforge.quantization.config import QuantConfig

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
_MIN_SCALE = 1e-12


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (codes [N, K] float8_e4m3fn, scales [N] float32), per output channel."""
    scales = weight.float().abs().amax(dim=1).clamp(min=_MIN_SCALE) / FP8_MAX
    codes = (weight.float() / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scales


def dequantize_fp8(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [N, K] fp8, scales [N] -> the weight [N, K] in dtype."""
    return codes.to(dtype) * scales[:, None].to(dtype)


def to_fnuz(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3fn codes and scales -> e4m3fnuz ones for the same weights: the bits read as half the value,
    so the scales double; e4m3fn's negative zero (0x80) is fnuz's NaN and becomes zero."""
    bits = codes.view(torch.int8).clone()
    bits[bits == -128] = 0
    return bits.view(torch.float8_e4m3fnuz), scales * 2


def fp8_scaled_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
    """x [M, K] float times fp8 codes [N, K] (scales [N]) with torch._scaled_mm; [M, N] in x's dtype.

    NOTE: the per-token and per-channel scales are applied to the fp32 output rather than passed to
    _scaled_mm, whose row-wise scaling needs bf16 output and a build with its CUTLASS kernels; unit
    per-tensor scales (`unit`, a float32 scalar 1) work on every fp8 device."""
    fp8_max = torch.finfo(codes.dtype).max
    x_scales = x.float().abs().amax(dim=1, keepdim=True).clamp(min=_MIN_SCALE) / fp8_max  # [M, 1]
    x_codes = (x.float() / x_scales).clamp(-fp8_max, fp8_max).to(codes.dtype)
    out = torch._scaled_mm(x_codes, codes.t(), scale_a=unit, scale_b=unit, out_dtype=torch.float32)
    return (out * x_scales * scales).to(x.dtype)


class Fp8DequantKernel(KernelModule):
    """The weight dequantized to the activation dtype at each call, then F.linear (the CPU, older GPUs)."""

    name = "dequant"

    def prepare(self, weights: tuple[torch.Tensor, torch.Tensor]) -> None:
        """weights: (codes [N, K] float8_e4m3fn, scales [N] float32)."""
        codes, scales = weights
        self.register_buffer("codes", codes.contiguous(), persistent=False)
        self.register_buffer("scales", scales.contiguous(), persistent=False)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return self.biased(F.linear(x, dequantize_fp8(self.codes, self.scales, x.dtype)))


class Fp8ScaledMMKernel(Fp8DequantKernel):
    """Activations quantized to fp8 per token, torch._scaled_mm with fp32 accumulation (fp8 GPUs)."""

    name = "scaled_mm"

    def prepare(self, weights: tuple[torch.Tensor, torch.Tensor]) -> None:
        codes, scales = weights
        # NOTE: the MI300 multiplies its own e4m3 variant (Platform.fp8_dtype), not the checkpoints' e4m3fn
        if _building_platform().fp8_dtype == torch.float8_e4m3fnuz:
            codes, scales = to_fnuz(codes, scales)
        super().prepare((codes, scales))
        self.register_buffer("unit_scale", torch.ones((), dtype=torch.float32), persistent=False)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return self.biased(fp8_scaled_mm(x, self.codes, self.scales, self.unit_scale))


def _building_platform() -> Platform:
    """The platform of the engine whose model is being built (its op table's), else the current one."""
    platform = current_ops().platform
    return platform if platform is not None else current_platform()


def select_fp8_kernel(device: torch.device, out_features: int, in_features: int) -> Fp8DequantKernel:
    """The layer's kernel: _scaled_mm where the device multiplies fp8 and the shape suits it (both widths
    multiples of 16), else dequantize + F.linear."""
    if device.type != "cuda" or out_features % 16 or in_features % 16 or not _building_platform().has_native_fp8:
        return Fp8DequantKernel()
    return Fp8ScaledMMKernel()


def fp8_checkpoint_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """An fp8 checkpoint's tensors with every `weight_scale` as a per-channel vector [rows of its weight]
    and `input_scale` dropped. A per-tensor scale waits for its weight's row count, or the reverse."""
    rows: dict[str, int] = {}  # layer -> rows of its weight, once seen
    waiting: dict[str, torch.Tensor] = {}  # layer -> per-tensor scale whose weight is not seen yet
    for name, tensor in weights:
        layer, _, kind = name.rpartition(".")
        if kind == "input_scale":
            continue
        if kind == "weight_scale" and tensor.numel() == 1:
            if layer not in rows:
                waiting[layer] = tensor
                continue
            tensor = tensor.reshape(1).float().expand(rows[layer])
        elif kind == "weight_scale":
            tensor = tensor.reshape(-1).float()
        yield name, tensor
        if kind == "weight" and tensor.dim() == 2:
            rows[layer] = tensor.shape[0]
            if layer in waiting:
                yield f"{layer}.weight_scale", waiting.pop(layer).reshape(1).float().expand(rows[layer])
    if waiting:
        raise ValueError(f"fp8 checkpoint has weight_scale without weight: {sorted(waiting)[:3]}")


class Fp8Method(LinearMethod):
    """from_float: quantize a float checkpoint at load time; otherwise load fp8 codes and scales."""

    def __init__(self, from_float: bool) -> None:
        self.from_float = from_float

    @classmethod
    def from_config(cls, config: QuantConfig, from_float: bool) -> Fp8Method:
        return cls(from_float)

    def create_weights(self, layer: Linear) -> None:
        if self.from_float:
            return
        device = layer.param_device
        drop_parameters(layer, "weight")
        codes = torch.zeros(layer.out_features, layer.in_features, dtype=FP8_DTYPE, device=device)
        layer.register_parameter("weight", torch.nn.Parameter(codes, requires_grad=False))
        scales = torch.zeros(layer.out_features, dtype=torch.float32, device=device)
        layer.register_parameter("weight_scale", torch.nn.Parameter(scales, requires_grad=False))

    def prepare_kernel(self, layer: Linear) -> Fp8DequantKernel:
        if self.from_float:
            codes, scales = quantize_fp8(layer.weight.data)
        else:
            codes, scales = layer.weight.data, layer.weight_scale.data.float()
        drop_parameters(layer, *[n for n, _ in layer.named_parameters(recurse=False) if n != "bias"])
        kernel = select_fp8_kernel(layer.param_device, layer.out_features, layer.in_features)
        kernel.prepare((codes, scales))
        kernel.bind(layer.out_features, layer.in_features, layer.bias)
        return kernel.to(layer.param_device)
