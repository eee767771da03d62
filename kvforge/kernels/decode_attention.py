"""Paged decode attention split over the key range (flash-decoding), in Triton.

Serves the sequences of a ragged batch with exactly one query token. At small batch a grid of one
program per (sequence, KV head) leaves most of the GPU idle, so the key range is cut in NUM_SPLITS:

    keys  [ split 0      | split 1      | split 2    ]    each program: partial (max, sum, acc)
                 \\             |             /
                  reduce kernel: out = sum_s w_s * acc_s / sum_s w_s * sum_s,  w_s = exp2(max_s - max)

With one split the decode kernel normalises and writes the output itself. The GROUP query heads of a
KV head share one program and one load of each key tile; they are padded to at least 16 rows, the
smallest tl.dot.

With a sliding window W the splits cut the keys the query sees, seq_len - W .. seq_len - 1, and the blocks
before them (which the cache may already have given back) are never read; the sinks join the softmax's
denominator where the output is normalised (the decode kernel with one split, else the reduce kernel).
"""

from __future__ import annotations

import torch

from kvforge.kernels.attention_tiles import (
    LOG2E_IN_KERNEL,
    NEG_BIG,
    AttentionOptions,
    fold_sinks,
    load_kv_tiles,
    online_softmax_step,
)
from kvforge.kernels.triton_compat import jit, next_power_of_2, tl
from kvforge.kernels.tuning import DecodeTiles


@jit
def _decode_kernel(
    out_ptr, partial_acc_ptr, partial_max_ptr, partial_sum_ptr,
    query_ptr, key_cache_ptr, value_cache_ptr, key_scale_ptr, value_scale_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, sinks_ptr, qk_scale, softcap_log2, sliding_window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_bt,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, QUANTIZED: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) - token != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_key = 0
    if sliding_window > 0:
        first_key = tl.maximum(seq_len - sliding_window, 0)
    keys_per_split = tl.cdiv(tl.cdiv(seq_len - first_key, NUM_SPLITS), BLOCK_N) * BLOCK_N
    key_start = first_key + split * keys_per_split
    key_end = tl.minimum(key_start + keys_per_split, seq_len)

    rows = tl.arange(0, BLOCK_G)
    head = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM_P)
    dim_mask = dims < HEAD_DIM
    io_mask = (rows < GROUP)[:, None] & dim_mask[None, :]
    q = tl.load(query_ptr + token.to(tl.int64) * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=io_mask, other=0.0)  # fmt: skip
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM_P], tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(key_start, key_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_mask = keys < key_end
        k, v = load_kv_tiles(key_cache_ptr, value_cache_ptr, key_scale_ptr, value_scale_ptr, block_table_ptr,
                             kv_head, keys, key_mask, dims, dim_mask, stride_cb, stride_cs, stride_ch,
                             stride_sb, stride_ss, PAGE_SIZE, QUANTIZED)  # fmt: skip
        visible = key_mask[None, :]
        m_i, l_i, acc = online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, softcap_log2, DOT_PRECISION,
                                            SOFTCAP)  # fmt: skip

    if NUM_SPLITS == 1:
        acc = fold_sinks(sinks_ptr, head, rows < GROUP, m_i, l_i, acc, HAS_SINKS)
        out_ptrs = out_ptr + token.to(tl.int64) * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        # partials: [num_seqs, num_heads, NUM_SPLITS] for max and sum, [..., HEAD_DIM_P] for acc
        part = ((seq * tl.num_programs(1) * GROUP + head) * NUM_SPLITS + split).to(tl.int64)
        tl.store(partial_max_ptr + part, m_i, mask=rows < GROUP)
        tl.store(partial_sum_ptr + part, l_i, mask=rows < GROUP)
        tl.store(partial_acc_ptr + part[:, None] * HEAD_DIM_P + dims[None, :], acc, mask=io_mask)


@jit
def _reduce_kernel(
    out_ptr, partial_acc_ptr, partial_max_ptr, partial_sum_ptr, query_start_loc_ptr, sinks_ptr, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) - token != 1:
        return
    splits = tl.arange(0, SPLITS_P)
    split_mask = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_DIM_P)
    part = (seq * tl.num_programs(1) + head).to(tl.int64) * NUM_SPLITS + splits
    m = tl.load(partial_max_ptr + part, mask=split_mask, other=float("-inf"))
    top = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E_IN_KERNEL
        top = tl.maximum(top, sink)
    weight = tl.exp2(m - top)  # 0 for padding and empty splits
    total = tl.sum(weight * tl.load(partial_sum_ptr + part, mask=split_mask, other=0.0), 0)
    if HAS_SINKS:
        total += tl.exp2(sink - top)
    acc_mask = split_mask[:, None] & (dims < HEAD_DIM)[None, :]
    acc = tl.load(partial_acc_ptr + part[:, None] * HEAD_DIM_P + dims[None, :], mask=acc_mask, other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / total
    out_ptrs = out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + dims
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def launch_decode(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_scale: torch.Tensor | None,
    value_scale: torch.Tensor | None,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    qk_scale: float,
    options: AttentionOptions,
    tiles: DecodeTiles,
    num_splits: int,
    upcast: bool,
) -> None:
    """Attention rows of the sequences with one query; inputs already checked by the caller (the key
    and value caches share strides, and so do the scales of a quantized cache, None otherwise)."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    head_dim_p = max(next_power_of_2(head_dim), 16)
    group = num_heads // num_kv_heads
    # NOTE: with one split the partials are never touched; a 1-element placeholder keeps pointers valid.
    partial_shape = (num_seqs, num_heads, num_splits) if num_splits > 1 else (1,)
    partial_max = torch.empty(partial_shape, dtype=torch.float32, device=query.device)
    partial_sum = torch.empty_like(partial_max)
    partial_acc = torch.empty((*partial_shape, head_dim_p), dtype=torch.float32, device=query.device)
    quantized = key_scale is not None
    if not quantized:  # NOTE: the caches stand in for the scale pointers, which are never read
        key_scale, value_scale = key_cache, value_cache
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, partial_acc, partial_max, partial_sum,
        query, key_cache, value_cache, key_scale, value_scale, block_tables, query_start_loc, seq_lens,
        options.sinks_or(query), qk_scale, options.softcap_log2, options.sliding_window,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), key_scale.stride(0), key_scale.stride(1),
        block_tables.stride(0),
        GROUP=group, BLOCK_G=max(next_power_of_2(group), 16), HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
        PAGE_SIZE=key_cache.shape[1], BLOCK_N=tiles.block_n, NUM_SPLITS=num_splits,
        UPCAST=upcast, DOT_PRECISION="ieee" if query.dtype == torch.float32 else None, QUANTIZED=quantized,
        SOFTCAP=options.softcap > 0, HAS_SINKS=options.sinks is not None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _reduce_kernel[(num_seqs, num_heads)](
            out, partial_acc, partial_max, partial_sum, query_start_loc, options.sinks_or(query), out.stride(0),
            out.stride(1), HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, NUM_SPLITS=num_splits,
            SPLITS_P=next_power_of_2(num_splits), HAS_SINKS=options.sinks is not None,
            num_warps=tiles.reduce_num_warps,
        )  # fmt: skip
