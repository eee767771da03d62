"""Weight-only quantized GEMM (W4A16, W8A16): y = x dequant(W)^T, dequantizing inside the K loop.

Weight layout (the "generic" layout every quantized checkpoint format is converted to):

    qweight  [N, K * bits / 8] uint8   8 bits: one code per byte
                                       4 bits: two codes per byte, column k in byte k // 2,
                                               low nibble for even k, high nibble for odd k
    scales   [N, G]            float   G = K / group_size groups along K
    zeros    [N, G]            float   zero point, in code units

    W[n, k] = (code[n, k] - zeros[n, k // group_size]) * scales[n, k // group_size]

The CPU has faster paths than this layout allows (C++ kernels on codes laid out for AVX2, torch's
prepacked int8/int4 GEMMs); see kvforge.kernels.cpu.packed_gemm.
"""

from __future__ import annotations

import torch

from kvforge.kernels.triton_compat import INTERPRETED, cdiv, jit, require_triton, tl
from kvforge.kernels.tuning import gemm_tiles
from kvforge.kernels.validation import FLOAT_DTYPES, check_same_device, check_tensor
from kvforge.platforms import Platform

WEIGHT_BITS = (4, 8)


def unpack_codes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """[N, K * bits / 8] uint8 -> [N, K] uint8 codes."""
    if bits == 8:
        return qweight
    low, high = qweight & 0xF, qweight >> 4
    return torch.stack([low, high], dim=-1).reshape(qweight.shape[0], -1)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[N, K] codes in [0, 2**bits) -> the uint8 qweight of the generic layout."""
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes.contiguous()
    pairs = codes.reshape(codes.shape[0], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def dequantize_ref(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int) -> torch.Tensor:
    """The float weight [N, K] (in scales' dtype) that the generic layout stands for."""
    codes = unpack_codes(qweight, bits)
    num_rows, num_groups = scales.shape
    grouped = codes.reshape(num_rows, num_groups, -1).to(scales.dtype)  # [N, G, group_size]
    return ((grouped - zeros[..., None]) * scales[..., None]).reshape(num_rows, -1)


def quant_gemm_ref(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int
) -> torch.Tensor:
    """x: [M, K]; returns x dequant(W)^T [M, N] in x's dtype, accumulated in fp32."""
    weight = dequantize_ref(qweight, scales.float(), zeros.float(), bits)
    return (x.float() @ weight.t()).to(x.dtype)


@jit
def _quant_gemm_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N, K, group_size,
    stride_xm, stride_wn, stride_sn, stride_om,
    BITS: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Grid (M blocks, N blocks). Each program walks K, dequantizing a [BLOCK_N, BLOCK_K] tile of
    codes per step and accumulating its dot with the [BLOCK_M, BLOCK_K] tile of x in fp32.

    BLOCK_K divides group_size (and so K): a K tile lies in one group, whose scales and zeros are one
    [BLOCK_N] vector each. NOTE: gathering them per element instead costs a 64-bit pointer per weight
    element and made every GPU build of this kernel spill registers."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + ks[None, :], mask=row_mask[:, None], other=0.0)
        if BITS == 4:  # byte j of the tile holds columns 2j (low nibble) and 2j + 1 (high nibble)
            bytes_k = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(w_ptr + cols64[:, None] * stride_wn + bytes_k[None, :], mask=col_mask[:, None],
                             other=0)  # fmt: skip
            codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, BLOCK_K))
        else:
            codes = tl.load(w_ptr + cols64[:, None] * stride_wn + ks[None, :], mask=col_mask[:, None], other=0)
        group_offsets = cols64 * stride_sn + k0 // group_size
        scale = tl.load(s_ptr + group_offsets, mask=col_mask, other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + group_offsets, mask=col_mask, other=0.0).to(tl.float32)
        weight = (codes.to(tl.float32) - zero[:, None]) * scale[:, None]  # [BLOCK_N, BLOCK_K]
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(weight))
        else:
            acc += tl.dot(x, tl.trans(weight.to(x.dtype)))
    out_mask = row_mask[:, None] & col_mask[None, :]
    tl.store(
        out_ptr + rows64[:, None] * stride_om + cols64[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=out_mask,
    )


def quant_gemm_triton(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, *,
    platform: Platform | None = None,
) -> torch.Tensor:
    """quant_gemm_ref in Triton. Tiles come from platform's tuning table (None: the current platform's), picked by
    M (decode vs prefill)."""
    require_triton()
    if bits not in WEIGHT_BITS:
        raise ValueError(f"bits must be one of {WEIGHT_BITS}, got {bits}")
    check_tensor("x", x, shape=(None, None), dtypes=FLOAT_DTYPES)
    num_tokens, in_features = x.shape
    if in_features * bits % 8:
        raise ValueError(f"K={in_features} does not fill whole bytes at {bits} bits")
    check_tensor("qweight", qweight, shape=(None, in_features * bits // 8), dtypes=(torch.uint8,))
    check_tensor("scales", scales, shape=(qweight.shape[0], None), dtypes=FLOAT_DTYPES)
    out_features, num_groups = scales.shape
    check_tensor("zeros", zeros, shape=tuple(scales.shape), dtypes=FLOAT_DTYPES)
    check_same_device(x=x, qweight=qweight, scales=scales, zeros=zeros)
    if zeros.stride() != scales.stride() or in_features % num_groups:
        raise ValueError(f"zeros must match scales' strides and K={in_features} split into {num_groups} groups")
    group_size = in_features // num_groups
    block_k = _block_k(gemm_tiles(num_tokens, platform).block_k, group_size)
    if block_k is None:  # groups of a size no tl.dot tile divides: dequantize, then one matmul
        return quant_gemm_ref(x, qweight, scales, zeros, bits)
    out = torch.empty((num_tokens, out_features), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or out_features == 0:
        return out
    tiles = gemm_tiles(num_tokens, platform)
    grid = (cdiv(num_tokens, tiles.block_m), cdiv(out_features, tiles.block_n))
    _quant_gemm_kernel[grid](
        x,
        qweight,
        scales,
        zeros,
        out,
        num_tokens,
        out_features,
        in_features,
        group_size,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        out.stride(0),
        BITS=bits,
        DOT_FP32=INTERPRETED or x.dtype == torch.float32,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=block_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out


def _block_k(tile_k: int, group_size: int) -> int | None:
    """The largest power of two <= tile_k that divides group_size, or None below tl.dot's minimum 16."""
    block_k = min(tile_k, group_size & -group_size)
    return block_k if block_k >= 16 else None
