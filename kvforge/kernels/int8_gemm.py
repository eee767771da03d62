"""W8A8: int8 activations x int8 weights -> int32, rescaled by per-token and per-channel scales.

    y[m, n] = (sum_k a[m, k] * b[n, k]) * a_scales[m] * b_scales[n]

The activations are quantized per token, dynamically (one scale per row, from its absolute max).
"""

from __future__ import annotations

import torch

from kvforge.kernels.triton_compat import cdiv, jit, require_triton, tl
from kvforge.kernels.tuning import gemm_tiles
from kvforge.kernels.validation import FLOAT_DTYPES, check_same_device, check_tensor
from kvforge.platforms import Platform

INT8_MAX = 127


def quantize_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] float -> (codes [M, K] int8, scales [M] fp32) with x ~= codes * scales[:, None]."""
    x32 = x.float()
    scales = x32.abs().amax(dim=-1).clamp(min=1e-8) / INT8_MAX  # [M]
    codes = torch.round(x32 / scales[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scales


def int8_gemm_ref(
    a: torch.Tensor, b: torch.Tensor, a_scales: torch.Tensor, b_scales: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """a: [M, K] int8, b: [N, K] int8, a_scales: [M], b_scales: [N] -> [M, N] in out_dtype.

    The integer products are summed exactly (int64), then rescaled in fp32."""
    products = (a.long() @ b.long().t()).float()  # [M, N]
    return (products * a_scales.float()[:, None] * b_scales.float()[None, :]).to(out_dtype)


@jit
def _int8_gemm_kernel(
    a_ptr, b_ptr, as_ptr, bs_ptr, out_ptr, M, N, K, stride_am, stride_bn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Grid (M blocks, N blocks); int32 accumulation, one fp32 rescale at the end."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(
            a_ptr + rows64[:, None] * stride_am + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0,
        )
        b = tl.load(
            b_ptr + cols64[:, None] * stride_bn + ks[None, :],
            mask=col_mask[:, None] & k_mask[None, :],
            other=0,
        )
        acc += tl.dot(a, tl.trans(b), out_dtype=tl.int32)
    a_scales = tl.load(as_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    b_scales = tl.load(bs_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    out = acc.to(tl.float32) * a_scales[:, None] * b_scales[None, :]
    tl.store(
        out_ptr + rows64[:, None] * stride_om + cols64[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def int8_gemm_triton(
    a: torch.Tensor, b: torch.Tensor, a_scales: torch.Tensor, b_scales: torch.Tensor, out_dtype: torch.dtype, *,
    platform: Platform | None = None,
) -> torch.Tensor:
    """int8_gemm_ref in Triton, in platform's tiles (None: the current platform's)."""
    require_triton()
    check_tensor("a", a, shape=(None, None), dtypes=(torch.int8,))
    num_tokens, in_features = a.shape
    check_tensor("b", b, shape=(None, in_features), dtypes=(torch.int8,))
    check_tensor("a_scales", a_scales, shape=(num_tokens,), dtypes=FLOAT_DTYPES)
    check_tensor("b_scales", b_scales, shape=(b.shape[0],), dtypes=FLOAT_DTYPES)
    check_same_device(a=a, b=b, a_scales=a_scales, b_scales=b_scales)
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be one of {FLOAT_DTYPES}, got {out_dtype}")
    out = torch.empty((num_tokens, b.shape[0]), dtype=out_dtype, device=a.device)
    if out.numel() == 0:
        return out
    tiles = gemm_tiles(num_tokens, platform)
    grid = (cdiv(num_tokens, tiles.block_m), cdiv(b.shape[0], tiles.block_n))
    _int8_gemm_kernel[grid](
        a,
        b,
        a_scales,
        b_scales,
        out,
        num_tokens,
        b.shape[0],
        in_features,
        a.stride(0),
        b.stride(0),
        out.stride(0),
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out
