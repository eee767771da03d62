"""Weight-only quantized matmul on AVX-512 VNNI CPUs: row panels with int8 activations (csrc/quant_panels.cpp).

One kernel for every batch size (decode, batched decode, prefill chunks): x is rounded to int8 per 32 columns and
one vpdpbusd multiplies 4 columns of 16 weight rows at once, so above a few rows it is several times the float
GEMM's rate and never dequantizes the weight. Layout, P = ceil(N / 16) panels of 16 rows (the last one padded with
zero rows), per 32-column block b of a panel V vectors of 64 bytes, one int32 lane (4 bytes) per row:

    codes    uint8 [P, K/32 * V * 64]
               8 bits, V = 8:  vector j = [row 0: c(32b+4j .. 32b+4j+3) | row 1: ... | ... | row 15: ...]
               4 bits, V = 4:  vector j, row r, byte c = c(r, 32b+8j+c) | c(r, 32b+8j+4+c) << 4
    scales   float16 [P, G, 16]    the panel's 16 rows side by side, per group, times 2^e
    offsets  float16 [P, G, 16]    -zeros * scales, times 2^e
    factor   2^-e                  one power of two per weight, that puts its largest scale or offset in
                                   [2^14, 2^15): no half is subnormal or overflows

    W[n, k] = (code[n, k] * scales[n, g] + offsets[n, g]) * factor,   g = k // group_size

Half factors cut a 4-bit weight's bytes from 0.75 to 0.625 per weight (as GGUF's Q4_1), and are exact for GGUF's
blocks, whose scales and minimums are halves; float32 ones (RTN, GPTQ's integer zero points times a scale) round by
at most 2^-11 of their value.

Reference beside it: panel_linear_ref (x rounded the same way, times the dequantized weight).
"""

from __future__ import annotations

import functools
import math

import torch

from kvforge.kernels.cpu.extension import cpu_kernels

PANEL_ROWS = 16
BLOCK = 32  # columns per scale of x, and the group-size unit


@functools.cache
def panels_available() -> bool:
    """The C++ extension is built with AVX-512 VNNI, which the panel kernel needs."""
    return cpu_kernels() is not None and torch.ops.kvforge_cpu.quant_panels_available()


def panel_layout_fits(bits: int, in_features: int, group_size: int) -> bool:
    return bits in (4, 8) and group_size % BLOCK == 0 and in_features % group_size == 0


def pack_panels(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """codes [N, K] in [0, 2**bits), scales and zeros [N, G] -> (codes, scales, offsets, factor) of the layout."""
    num_rows, in_features = codes.shape
    if not panel_layout_fits(bits, in_features, in_features // scales.shape[1]):
        raise ValueError(f"no panel layout for {bits}-bit codes of width {in_features} in {scales.shape[1]} groups")
    pad = -num_rows % PANEL_ROWS
    codes = torch.nn.functional.pad(codes.to(torch.uint8), (0, 0, 0, pad))
    offsets = torch.nn.functional.pad(-zeros.float() * scales.float(), (0, 0, 0, pad))
    scales = torch.nn.functional.pad(scales.float(), (0, 0, 0, pad))
    panels = codes.shape[0] // PANEL_ROWS
    blocks = codes.reshape(panels, PANEL_ROWS, in_features // BLOCK, BLOCK)  # [P, r, b, 32]
    if bits == 8:
        vectors = blocks.reshape(panels, PANEL_ROWS, -1, 8, 4)  # [P, r, b, j, c]
    else:
        halves = blocks.reshape(panels, PANEL_ROWS, -1, 4, 2, 4)  # [P, r, b, j, low/high, c]
        vectors = halves[..., 0, :] | (halves[..., 1, :] << 4)
    packed = vectors.permute(0, 2, 3, 1, 4).reshape(panels, -1)  # [P, (b, j, r, c)]

    largest = max(scales.abs().max().item(), offsets.abs().max().item())
    exponent = 0 if largest == 0 else 14 - math.floor(math.log2(largest))

    def side_by_side(factors: torch.Tensor) -> torch.Tensor:
        halves = (factors * 2.0**exponent).to(torch.float16)
        return halves.reshape(panels, PANEL_ROWS, -1).transpose(1, 2).contiguous()

    return packed.contiguous(), side_by_side(scales), side_by_side(offsets), 2.0**-exponent


def panel_rows(
    codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, factor: float, bits: int, ids: torch.Tensor
) -> torch.Tensor:
    """The float32 weight rows W[ids] [len(ids), K] of the layout (an embedding lookup)."""
    panels, lanes = ids // PANEL_ROWS, ids % PANEL_ROWS
    vectors = 8 if bits == 8 else 4
    grid = codes.reshape(codes.shape[0], -1, vectors, PANEL_ROWS, 4)[panels, :, :, lanes]  # [len, b, j, c]
    if bits == 4:
        grid = torch.stack([grid & 0x0F, grid >> 4], dim=-2)  # [len, b, j, low/high, c]
    row_codes = grid.reshape(ids.shape[0], -1).float()
    group_size = row_codes.shape[1] // scales.shape[1]
    row_scales = scales[panels, :, lanes].float().repeat_interleave(group_size, dim=1)
    row_offsets = offsets[panels, :, lanes].float().repeat_interleave(group_size, dim=1)
    return (row_codes * row_scales + row_offsets) * factor


def panel_linear(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, factor: float, bits: int,
    out_features: int, prefetch_next: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [M, K] float -> x W^T [M, out_features] in x's dtype (needs panels_available()). prefetch_next: the
    (codes, scales, offsets) of the weight multiplied by next, whose first bytes each thread then prefetches while
    it finishes this one (the result does not depend on it)."""
    out = torch.ops.kvforge_cpu.quant_gemm_panels(x.float(), codes, scales, offsets, bits, out_features, factor,
                                                  *(prefetch_next or (None, None, None)))
    return out.to(x.dtype)


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels with int8 activations (this one, the AVX2 GEMV) see it: per 32 columns, dx = max |x| / 127
    and q = round(x / dx), then dx * q."""
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)
    dx = blocks.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.where(dx > 0, torch.round(blocks / torch.where(dx > 0, dx, 1)), 0)
    assert q.abs().max() <= 127
    return (q * dx).reshape(x.shape)


def panel_linear_ref(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, factor: float, bits: int,
    out_features: int,
) -> torch.Tensor:
    """What panel_linear computes, in float64: x rounded to int8 per 32 columns, times the dequantized weight."""
    weight = panel_rows(codes, scales, offsets, factor, bits, torch.arange(out_features))
    return int8_rows(x).double() @ weight.double().t()
