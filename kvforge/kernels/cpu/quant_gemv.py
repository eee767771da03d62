"""Weight-only quantized matmul on the CPU (W8A16, W4A16): the C++ kernels of csrc/quant_gemv.cpp.

The layer keeps its codes at 8 or 4 bits in the layout below and never holds a float weight. Up to
GEMV_MAX_TOKENS rows (decode), the kernel streams the codes; above, the weight is dequantized to float32
for the call and multiplied by F.linear (prefill is compute-bound, and a float GEMM beats re-decoding the
codes for every few rows). The GEMV either multiplies x as given in fp32, or, with int8_activations (AVX2),
first rounds x to int8 with one scale per 32 columns (as llama.cpp's Q8 activations) and sums integer
products (csrc/quant_gemv_int8.cpp): fewer instructions per code, so that it runs nearer memory speed, for an
error of at most 1/254 of its block's largest |x| on each element of x.

    qweight  uint8 [N, K * bits / 8]   codes, in blocks of 32 bytes (8 bits: 32 columns, 4 bits: 64)
    scales   float32 [N, G]
    offsets  float32 [N, G]            offsets = -zeros * scales

    W[n, k] = code[n, k] * scales[n, g] + offsets[n, g],   g = k // group_size

A block is eight little-endian 32-bit words; word i holds columns i, 8 + i, 16 + i, ... of the block
(8 bits: byte j = column 8j + i; 4 bits: nibble j, low nibble first = column 8j + i):

    block columns   0  1 .. 7 | 8  9 .. 15 | ...          word i, 8-bit:  [ c_i | c_8+i | c_16+i | c_24+i ]
    word            0  1 .. 7 | 0  1 ..  7 | ...                  4-bit:  [ c_i | c_8+i | ... | c_56+i ]

so the kernel decodes the j-th vector of 8 columns with one AND (or a shift) in place, no shuffle.

Zero points may be fractional (GGUF's Q4_1 stores a float minimum): they only enter the offsets.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kvforge.kernels.cpu.extension import cpu_kernels

GEMV_MAX_TOKENS = 16  # rows of x up to which the kernel beats dequantize + F.linear
DEQUANT_TILE_BYTES = 8 * 2**20  # float32 weight rows dequantized at once above GEMV_MAX_TOKENS (L3-sized)
CODE_BLOCK = 32  # columns per decoded block (a packed 4-bit block holds two); group sizes are multiples


@functools.cache
def native_kernels_available() -> bool:
    """The C++ extension is built and its kernels are the vectorized (AVX2) ones. Elsewhere (aarch64, old
    x86) they compile to a portable fallback that is slower than a float GEMM."""
    return cpu_kernels() is not None and torch.ops.kvforge_cpu.quant_gemv_vectorized()


def layout_fits(bits: int, in_features: int, group_size: int) -> bool:
    """Whether a weight of these parameters has the layout: whole 32-column blocks per group, and whole
    blocks of 32 bytes per row."""
    return (
        bits in (4, 8)
        and group_size % CODE_BLOCK == 0
        and in_features % group_size == 0
        and in_features % (CODE_BLOCK * 8 // bits) == 0
    )


def pack_weight(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes [N, K] in [0, 2**bits), scales and zeros [N, G] -> (qweight, scales, offsets) of the layout."""
    num_rows, in_features = codes.shape
    if not layout_fits(bits, in_features, in_features // scales.shape[1]):
        raise ValueError(f"no CPU layout for {bits}-bit codes of width {in_features} in {scales.shape[1]} groups")
    block_columns = CODE_BLOCK * 8 // bits  # 32 bytes per block
    lanes = codes.to(torch.uint8).reshape(num_rows, -1, block_columns // 8, 8).transpose(-1, -2)  # [N, blocks, i, j]
    if bits == 8:
        qweight = lanes.reshape(num_rows, -1)
    else:
        nibbles = lanes.reshape(num_rows, -1, 2)  # j = 2b, 2b + 1 in byte b of the word
        qweight = nibbles[..., 0] | (nibbles[..., 1] << 4)
    scales = scales.float()
    offsets = -zeros.float() * scales
    return qweight.contiguous(), scales.contiguous(), offsets.contiguous()


def quant_linear_cpu(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int,
    int8_activations: bool,
) -> torch.Tensor:
    """x: [M, K] float -> x W^T: [M, N] in x's dtype. Needs the CPU extension loaded (cpu_kernels()), and its
    AVX2 build (native_kernels_available()) for int8_activations: the GEMV rounds x to int8 per 32 columns."""
    if x.shape[0] <= GEMV_MAX_TOKENS:
        out = torch.ops.kvforge_cpu.quant_gemv(x.float(), qweight, scales, offsets, bits, int8_activations)
        return out.to(x.dtype)
    # NOTE: dequantized a tile of rows at a time, so that a large weight (an LM head of 49152 rows) is
    # multiplied from cache instead of written out to memory as float32 and read back.
    tile = max(1, DEQUANT_TILE_BYTES // (4 * x.shape[1]))
    outs = [F.linear(x, torch.ops.kvforge_cpu.quant_dequantize(qweight[n : n + tile], scales[n : n + tile],
                                                               offsets[n : n + tile], bits).to(x.dtype))
            for n in range(0, qweight.shape[0], tile)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
