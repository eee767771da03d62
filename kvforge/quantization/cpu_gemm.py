"""The CPU's fastest quantized GEMMs: torch's prepacked int8 (`_weight_int8pack_mm`) and int4
(`_weight_int4pack_mm_for_cpu`) kernels.

Measured on a 2-core AVX2 EPYC (one thread, torch 2.13, SmolLM2-135M shapes), against fp32 F.linear:

    shape (N x K)   M   fp32 F.linear   int8pack bf16   int4pack bf16   int8pack/int4pack fp32
    576 x 576       1        44 us           38 us           55 us            317 / 663 us
    1536 x 576      1        88 us           89 us          143 us           1272 / 1837 us
    576 x 1536      64     1773 us         2647 us         2857 us          67509 / 113862 us

Both kernels are only fast with bfloat16 activations (their fp32 path is a slow fallback), so fp32
inputs are rounded to bfloat16 on the way in. For int8 weights at larger batches, dequantizing to
the activation dtype and calling F.linear is faster (and exact); int4 stays on int4pack, whose
packed layout has no cheaper dequantization.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge.kernels.cpu_extension import cpu_kernels
from kvforge.kernels.quant_gemv_cpu import layout_fits
from kvforge.quantization.quantized_weight import QuantizedWeight

INT8PACK_MAX_TOKENS = 16  # above this many rows, dequantize + F.linear beats int8pack
INT4PACK_GROUP_SIZES = (32, 64, 128, 256)


def _has_op(name: str) -> bool:
    return hasattr(torch.ops.aten, name)


def native_eligible(weight: QuantizedWeight) -> bool:
    """The C++ kernels take 4- and 8-bit codes with any zero points, in groups of whole 32-column blocks."""
    return cpu_kernels() is not None and layout_fits(weight.bits, weight.codes.shape[1], weight.group_size)


def int8pack_eligible(weight: QuantizedWeight) -> bool:
    """Symmetric per-row 8-bit codes (zero point 128) fit int8pack."""
    return (
        _has_op("_weight_int8pack_mm")
        and weight.bits == 8
        and weight.scales.shape[1] == 1
        and bool((weight.zeros == 128).all())
    )


def int4pack_eligible(weight: QuantizedWeight) -> bool:
    num_rows, in_features = weight.codes.shape
    return (
        _has_op("_convert_weight_to_int4pack_for_cpu")
        and weight.bits == 4
        and num_rows % 16 == 0
        and weight.group_size in INT4PACK_GROUP_SIZES
        and in_features % weight.group_size == 0
    )


def prepack_int8(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes - 128 as int8 [N, K], per-row scales [N] float32)."""
    return (weight.codes.to(torch.int16) - 128).to(torch.int8).contiguous(), weight.scales[
        :, 0
    ].float().contiguous()


def int8pack_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x: [M, K] -> x (codes * scales)^T: [M, N] in x's dtype."""
    if x.shape[0] <= INT8PACK_MAX_TOKENS:
        out = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), codes, scales.to(torch.bfloat16))
        return out.to(x.dtype)
    return F.linear(x, codes.to(x.dtype)) * scales.to(x.dtype)


def prepack_int4(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes [N, K / 2] uint8, scales_and_zeros [G, N, 2] bfloat16).

    NOTE: the kernel computes (code - 8) * scale + zero, so our (code - z) * s stores zero = (8 - z) * s."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.codes.to(torch.int32).contiguous(), 1)
    scales = weight.scales.float()
    offsets = (8 - weight.zeros.float()) * scales
    scales_zeros = torch.stack([scales.t(), offsets.t()], dim=-1).to(torch.bfloat16).contiguous()
    return packed, scales_zeros


def int4pack_linear(
    x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, group_size, scales_zeros)
    return out.to(x.dtype)
