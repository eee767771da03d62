"""The CPU's quantized GEMMs, and which one a weight-only layer gets (select_kernel):

    panels    the C++ kernel of csrc/quant_panels.cpp (kvforge/kernels/cpu/quant_panels.py), on AVX-512 VNNI
              machines: 4-, 6- and 8-bit codes, any zero points, 16 weight rows interleaved per panel, activations
              rounded to int8 per 32 columns at every batch size (decode, batches and prompts alike)
    native    the C++ kernels of csrc/quant_gemv.cpp (kvforge/kernels/cpu/quant_gemv.py): 4- and 8-bit codes
              as stored, any zero points, activations rounded to int8 per 32 columns, fp32 accumulation;
              above 16 rows, dequantize + F.linear. Whenever the extension is built with AVX2 and groups are
              whole 32-column blocks.
    int8pack  torch's `_weight_int8pack_mm`: symmetric per-row 8-bit codes (zero point 128)
    int4pack  torch's `_weight_int4pack_mm_for_cpu`: 4-bit, rows a multiple of 16, groups 32 to 256
    generic   anything else: kvforge.kernels.quant_gemm (dequantize + matmul)

The last three are the torch fallback, without the extension (no compiler, KVFORGE_NO_CPU_EXTENSION=1)
or without AVX2 (there the extension compiles a portable fallback that is slower than a float GEMM).

Measured with `python -m kvforge.benchmarks.quant_gemv_cpu [--threads 2]` on a 2-vCPU AVX2 EPYC, torch 2.13,
fastest of 10 interleaved rounds (rough: the machine was shared). Per call with the weights in cache,
one thread; and per pass over a model's worth of layers (30 x qkv 960x576, o 576x576, gate_up
3072x576, down 576x1536), whose weights stream from memory as in decode:

    shape (N x K)        M   fp32 F.linear   native int8   native int4   int8pack bf16   int4pack bf16
    3072 x 576           1       188 us         145 us        111 us         165 us          260 us
    3072 x 576           4       514 us         294 us        303 us         362 us          350 us
    3072 x 576          16      1007 us        1111 us       1179 us        1369 us         1376 us
    576 x 1536           1        82 us          74 us         63 us          85 us          135 us
    30 layers, 1 thread  1      30.8 ms        17.4 ms        9.8 ms        20.8 ms         17.2 ms
    30 layers, 1 thread  16     85.2 ms        74.1 ms       74.5 ms        92.1 ms         83.3 ms
    30 layers, 2 threads 1      28.7 ms        10.2 ms        6.0 ms        12.3 ms          9.7 ms
    30 layers, 2 threads 16     64.9 ms        41.2 ms       41.5 ms        55.5 ms         44.8 ms

int8pack and int4pack are only fast with bfloat16 activations (their fp32 path is 7-60x slower than
F.linear), so fp32 inputs are rounded to bfloat16 on the way in. For int8 weights at larger batches,
dequantizing to the activation dtype and calling F.linear is faster (and exact); int4 stays on
int4pack, whose packed layout has no cheaper dequantization.

On an AVX-512 VNNI machine (Intel Xeon, Sapphire Rapids class, 2 vCPUs, 26-27 GB/s copy), the same command with
`--threads 2 --tokens 1,16,64 --rounds 6`, 2026-12-02 (commit 1597585: half scales), fastest round:

    shape (N x K)        M   fp32 F.linear   native int4 q8x   panels int8   panels int4
    3072 x 576           1       128 us          36 us            21 us         18 us
    3072 x 576          16       388 us         361 us            98 us        100 us
    3072 x 576          64       975 us        1462 us           429 us        363 us
    30 layers            1      16.8 ms         4.7 ms           5.5 ms        3.9 ms   (panels: 82% / 63% of copy)
    30 layers           16      40.1 ms        23.7 ms          10.8 ms        9.2 ms
    30 layers           64      66.3 ms        79.8 ms          36.7 ms       36.8 ms
    LM head 49152 x 576  1       4.2 ms         0.8 ms           1.1 ms        0.7 ms   (panels: 107% / 97% of copy)
    LM head 49152 x 576 64      16.6 ms        22.7 ms           5.9 ms        6.0 ms

so there the panel kernel is 1.8-4.3x the float GEMM from 16 rows up, where the other quantized paths are
slower than it, and faster than the int8 GEMV for one row (3.9 against 4.7 ms over the layers). ("native int4 q8x"
was timed with an AVX-512 VNNI step the GEMV had then, removed since: on these machines no layer reaches the GEMV.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvforge.kernels.cpu.quant_gemv import layout_fits, native_kernels_available
from kvforge.kernels.cpu.quant_panels import panel_layout_fits, panels_available

if TYPE_CHECKING:
    from kvforge.quantization.quantized_weight import QuantizedWeight

INT8PACK_MAX_TOKENS = 16  # above this many rows, dequantize + F.linear beats int8pack
INT4PACK_GROUP_SIZES = (32, 64, 128, 256)


def _has_op(name: str) -> bool:
    return hasattr(torch.ops.aten, name)


def panels_eligible(weight: QuantizedWeight) -> bool:
    """The AVX-512 VNNI panel kernel takes 4-, 6- and 8-bit codes with any zero points, in groups of whole 32-column
    blocks or of half a block (16 columns: GGUF's Q6_K, Q3_K, Q2_K) in rows of whole blocks."""
    return panels_available() and panel_layout_fits(weight.bits, weight.codes.shape[1], weight.group_size)


def native_eligible(weight: QuantizedWeight) -> bool:
    """The C++ kernels take 4- and 8-bit codes with any zero points, in groups of whole 32-column blocks."""
    return native_kernels_available() and layout_fits(weight.bits, weight.codes.shape[1], weight.group_size)


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
