"""Multi-head latent attention (MLA, DeepSeek-V2/V3) decode over the paged latent cache.

Each cached token holds one row shared by every head: the normalized KV latent c (latent_dim) and the
roped key k_r (rope_dim). With the key and value up-projections absorbed into the query and the output,
a decode query attends to those rows directly:

    cache row   [ c (latent_dim)            | k_r (rope_dim) ]
    query       [ q_nope @ W_UK (latent_dim) | q_r (rope_dim) ]      score = query . row * scale
    output      sum over tokens of softmax(score) * c             (then @ W_UV^T by the caller)

The Triton kernel runs flash-decoding: a program per (sequence, block of BLOCK_H heads, key split),
the splits merged by the decode attention's reduce kernel.
"""

from __future__ import annotations

import math

import torch

from kvforge.kernels.attention_tiles import LOG2E, NEG_BIG
from kvforge.kernels.decode_attention import _reduce_kernel as reduce_splits_kernel
from kvforge.kernels.paged_attention import gather_kv
from kvforge.kernels.triton_compat import INTERPRETED, cdiv, jit, next_power_of_2, require_triton, tl
from kvforge.kernels.tuning import kernel_tuning
from kvforge.kernels.validation import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_matches,
    check_same_device,
    check_tensor,
)
from kvforge.platforms import Platform, current_platform

HEADS_PER_PROGRAM = 16  # the smallest tl.dot tile; 128 DeepSeek heads make 8 programs per sequence and split


def mla_decode_ref(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    latent_dim: int,
) -> torch.Tensor:
    """query: [num_seqs, num_heads, latent_dim + rope_dim], one decode query per sequence;
    latent_cache: [num_blocks, block_size, latent_dim + rope_dim]; block_tables: [num_seqs, max_blocks];
    seq_lens: [num_seqs], the context of each query including its own token.

    Returns [num_seqs, num_heads, latent_dim]: softmax(query . cache * scale) @ cache[..., :latent_dim],
    in fp32, rounded once."""
    max_len = int(seq_lens.max()) if seq_lens.numel() else 0
    rows = gather_kv(latent_cache, block_tables, max_len).float()  # [num_seqs, max_len, latent + rope]
    scores = torch.matmul(query.float(), rows.transpose(1, 2)) * scale  # [num_seqs, num_heads, max_len]
    visible = torch.arange(max_len, device=query.device)[None, None, :] < seq_lens[:, None, None]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.matmul(probs, rows[..., :latent_dim]).to(query.dtype)


@jit
def _mla_decode_kernel(
    out_ptr, partial_acc_ptr, partial_max_ptr, partial_sum_ptr,
    query_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, qk_scale, num_heads,
    stride_qs, stride_qh, stride_os, stride_oh, stride_cb, stride_cs, stride_bt,
    LATENT: tl.constexpr, LATENT_P: tl.constexpr, ROPE: tl.constexpr, ROPE_P: tl.constexpr,
    BLOCK_H: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    keys_per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    key_start = split * keys_per_split
    key_end = tl.minimum(key_start + keys_per_split, seq_len)

    head_mask = heads < num_heads
    lat = tl.arange(0, LATENT_P)
    rope = tl.arange(0, ROPE_P)
    q_rows = query_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh
    q_lat = tl.load(q_rows + lat[None, :], mask=head_mask[:, None] & (lat < LATENT)[None, :], other=0.0)
    q_rope = tl.load(q_rows + LATENT + rope[None, :], mask=head_mask[:, None] & (rope < ROPE)[None, :],
                     other=0.0)  # fmt: skip
    if UPCAST:  # the interpreter's tl.dot is wrong on bf16 operands
        q_lat = q_lat.to(tl.float32)
        q_rope = q_rope.to(tl.float32)

    m_i = tl.full([BLOCK_H], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, LATENT_P], tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(key_start, key_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_mask = keys < key_end
        block_ids = tl.load(block_table_ptr + keys // PAGE_SIZE, mask=key_mask, other=0).to(tl.int64)
        rows = (block_ids * stride_cb + (keys % PAGE_SIZE) * stride_cs)[:, None]
        c = tl.load(cache_ptr + rows + lat[None, :], mask=key_mask[:, None] & (lat < LATENT)[None, :],
                    other=0.0)  # fmt: skip
        k_r = tl.load(cache_ptr + rows + LATENT + rope[None, :],
                      mask=key_mask[:, None] & (rope < ROPE)[None, :], other=0.0)  # fmt: skip
        if UPCAST:
            c = c.to(tl.float32)
            k_r = k_r.to(tl.float32)
        scores = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        scores = tl.dot(q_rope, tl.trans(k_r), scores, input_precision=DOT_PRECISION) * qk_scale
        scores = tl.where(key_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    io_mask = head_mask[:, None] & (lat < LATENT)[None, :]
    if NUM_SPLITS == 1:
        acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        out_ptrs = out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + lat[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        # partials: [num_seqs, num_heads, NUM_SPLITS] for max and sum, [..., LATENT_P] for acc: the
        # layout the decode attention's reduce kernel merges
        part = ((seq * num_heads + heads) * NUM_SPLITS + split).to(tl.int64)
        tl.store(partial_max_ptr + part, m_i, mask=head_mask)
        tl.store(partial_sum_ptr + part, l_i, mask=head_mask)
        tl.store(partial_acc_ptr + part[:, None] * LATENT_P + lat[None, :], acc, mask=io_mask)


def _check_mla_inputs(
    query: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    scale: float, latent_dim: int,
) -> None:  # fmt: skip
    check_tensor("query", query, shape=(None, None, None), dtypes=FLOAT_DTYPES)
    num_seqs, _, row_dim = query.shape
    check_tensor("latent_cache", latent_cache, shape=(None, None, row_dim), dtypes=(query.dtype,))
    check_tensor("block_tables", block_tables, shape=(num_seqs, None), dtypes=INDEX_DTYPES)
    check_tensor("seq_lens", seq_lens, shape=(num_seqs,), dtypes=INDEX_DTYPES)
    check_same_device(query=query, latent_cache=latent_cache, block_tables=block_tables, seq_lens=seq_lens)
    if not 0 < latent_dim < row_dim:
        raise ValueError(f"latent_dim must be in [1, {row_dim - 1}] (query width - 1), got {latent_dim}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite float, got {scale}")


def _num_splits(num_seqs: int, head_blocks: int, num_splits: int | None, platform: Platform) -> int:
    """The key-range splits: the caller's, or the tuning table's for platform."""
    if num_splits is None:
        num_splits = kernel_tuning(platform).decode.num_splits(num_seqs, head_blocks, platform.num_compute_units)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    return num_splits


def mla_decode_triton(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    latent_dim: int,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    platform: Platform | None = None,
) -> torch.Tensor:
    """mla_decode_ref in Triton, with no host sync. out: a preallocated [num_seqs, num_heads, latent_dim]
    buffer; num_splits: override the key-range splits (default: from the tuning table and device size)."""
    require_triton()
    _check_mla_inputs(query, latent_cache, block_tables, seq_lens, scale, latent_dim)
    num_seqs, num_heads, row_dim = query.shape
    out_shape = torch.Size((num_seqs, num_heads, latent_dim))
    if out is None:
        out = torch.empty(out_shape, dtype=query.dtype, device=query.device)
    check_matches("out", out, shape=out_shape, dtype=query.dtype, device=query.device, contiguous=True)
    if num_seqs == 0:
        return out
    platform = platform if platform is not None else current_platform()  # whose tiles (None: the current one's)
    tiles, head_blocks = kernel_tuning(platform).decode, cdiv(num_heads, HEADS_PER_PROGRAM)
    num_splits = _num_splits(num_seqs, head_blocks, num_splits, platform)
    latent_p = max(next_power_of_2(latent_dim), 16)
    partial_shape = (num_seqs, num_heads, num_splits) if num_splits > 1 else (1,)
    partial_max = torch.empty(partial_shape, dtype=torch.float32, device=query.device)
    partial_sum = torch.empty_like(partial_max)
    partial_acc = torch.empty((*partial_shape, latent_p), dtype=torch.float32, device=query.device)
    _mla_decode_kernel[(num_seqs, head_blocks, num_splits)](
        out, partial_acc, partial_max, partial_sum,
        query, latent_cache, block_tables, seq_lens, scale * LOG2E, num_heads,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), block_tables.stride(0),
        LATENT=latent_dim, LATENT_P=latent_p, ROPE=row_dim - latent_dim,
        ROPE_P=max(next_power_of_2(row_dim - latent_dim), 16), BLOCK_H=HEADS_PER_PROGRAM,
        PAGE_SIZE=latent_cache.shape[1], BLOCK_N=tiles.mla_block_n, NUM_SPLITS=num_splits,
        UPCAST=INTERPRETED and query.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        one_query_each = torch.arange(num_seqs + 1, dtype=torch.int32, device=query.device)
        reduce_splits_kernel[(num_seqs, num_heads)](
            out, partial_acc, partial_max, partial_sum, one_query_each, out, out.stride(0), out.stride(1),
            HEAD_DIM=latent_dim, HEAD_DIM_P=latent_p, NUM_SPLITS=num_splits,
            SPLITS_P=next_power_of_2(num_splits), HAS_SINKS=False, num_warps=tiles.reduce_num_warps,
        )  # fmt: skip
    return out
