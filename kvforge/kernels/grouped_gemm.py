"""The grouped GEMM of rows sorted into groups (moe_align): each program multiplies BLOCK_M rows of one group by
that group's matrix. The experts of fused MoE are its groups (kernels/fused_moe.py), and so are the adapters of
segmented LoRA (kernels/lora.py).

    rows      a [M, K]            (row of pair p: p // PAIRS_PER_A_ROW)
    groups    b [G, N, K]         (row-major N x K per group)
    out       out[p] = a[row of p] @ b[group of p's block]^T, times pair_weights[p] with APPLY_WEIGHT
"""

from __future__ import annotations

import torch

from kvforge.kernels.triton_compat import INTERPRETED, cdiv, jit, tl
from kvforge.kernels.tuning import GemmTiles


@jit
def block_pairs(sorted_pair_ids_ptr, block, num_pairs, n_size, PAIRS_PER_A_ROW: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):  # fmt: skip
    """The BLOCK_M sorted pairs of `block` and this program's BLOCK_N columns: (pair_ids, row_mask, a_rows, cols,
    col_mask); a_rows are the pairs' rows of a (int64)."""
    pair_ids = tl.load(sorted_pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pair_ids < num_pairs
    a_rows = (pair_ids // PAIRS_PER_A_ROW).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return pair_ids, row_mask, a_rows, cols, cols < n_size


@jit
def store_pairs(out_ptr, acc, pair_weights_ptr, pair_ids, row_mask, cols, col_mask, stride_om,
                APPLY_WEIGHT: tl.constexpr):  # fmt: skip
    """out[pair, cols] = acc (times pair_weights[pair] with APPLY_WEIGHT), for the valid pairs and columns."""
    if APPLY_WEIGHT:
        acc = acc * tl.load(pair_weights_ptr + pair_ids, mask=row_mask, other=0.0)[:, None]
    out_ptrs = out_ptr + pair_ids[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@jit
def _grouped_gemm_kernel(
    out_ptr, a_ptr, b_ptr, pair_weights_ptr, sorted_pair_ids_ptr, block_expert_ids_ptr,
    num_pairs, n_size, k_size, stride_am, stride_be, stride_bn, stride_om,
    PAIRS_PER_A_ROW: tl.constexpr, APPLY_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid (row blocks, column blocks). For the BLOCK_M sorted pairs of one block, all of one expert e:
    out[pair, cols] = a[pair // PAIRS_PER_A_ROW] @ b[e, cols, :]^T (times pair_weights[pair]); b is read in a's
    dtype (LoRA weights may be of another than the activations)."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ids_ptr + block)
    if expert < 0:
        return
    pair_ids, row_mask, a_rows, cols, col_mask = block_pairs(sorted_pair_ids_ptr, block, num_pairs, n_size,
                                                             PAIRS_PER_A_ROW, BLOCK_M, BLOCK_N)
    b_cols = b_ptr + expert.to(tl.int64) * stride_be + cols[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, k_size, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_mask = ks < k_size
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        b = tl.load(b_cols + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0).to(a.dtype)
        if UPCAST:  # the interpreter's tl.dot is wrong on bf16 operands
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    store_pairs(out_ptr, acc, pair_weights_ptr, pair_ids, row_mask, cols, col_mask, stride_om, APPLY_WEIGHT)


def launch_grouped_gemm(
    out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, pair_weights: torch.Tensor | None,
    sorted_pair_ids: torch.Tensor, block_expert_ids: torch.Tensor, pairs_per_a_row: int, tiles: GemmTiles,
) -> None:  # fmt: skip
    """out[pair] = a[pair // pairs_per_a_row] @ b[group]^T (times pair_weights[pair]) for the rows of each block of
    sorted_pair_ids, block_expert_ids[block] its group (-1: skipped); rows of no block are not written."""
    num_experts, n_size, k_size = b.shape
    grid = (block_expert_ids.shape[0], cdiv(n_size, tiles.block_n))
    _grouped_gemm_kernel[grid](
        out, a, b, out if pair_weights is None else pair_weights, sorted_pair_ids, block_expert_ids,
        out.shape[0], n_size, k_size, a.stride(0), b.stride(0), b.stride(1), out.stride(0),
        PAIRS_PER_A_ROW=pairs_per_a_row, APPLY_WEIGHT=pair_weights is not None,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        UPCAST=INTERPRETED and a.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
