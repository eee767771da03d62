"""Varlen causal prefill attention over the paged KV cache, FlashAttention-2 style, in Triton.

Serves the sequences of a ragged batch with more than one query token (fresh prefills and prefill
chunks after earlier chunks or prefix-cache hits); one-token queries go to the decode kernel.

The grid is (query tiles, KV heads). A program takes BLOCK_Q query tokens of one sequence times the
GROUP query heads that share one KV head, so each key and value tile is loaded once per group:

    rows r = 0 .. BLOCK_Q * GROUP_P - 1     token = r // GROUP_P     head = kv_head * GROUP + r % GROUP_P

Sequence s owns the tiles starting at query_start_loc[s] // BLOCK_Q + s, so the grid needs no host
sync: num_tokens // BLOCK_Q + num_seqs tiles cover every sequence, and spare programs exit at once.

With a sliding window W a tile starts at the first key its first query sees (its first position - W + 1):
the blocks before it, which the cache may already have given back, are never read.
"""

from __future__ import annotations

import torch

from kvforge.kernels.attention_tiles import NEG_BIG, AttentionOptions, fold_sinks, load_kv_tiles, online_softmax_step
from kvforge.kernels.triton_compat import jit, next_power_of_2, tl
from kvforge.kernels.tuning import PrefillTiles


@jit
def _find_sequence(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence s whose first tile, query_start_loc[s] // BLOCK_Q + s, is <= tile."""
    lo = 0
    hi = num_seqs
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid
        else:
            hi = mid
    return lo


@jit
def _prefill_kernel(
    out_ptr, query_ptr, key_cache_ptr, value_cache_ptr, key_scale_ptr, value_scale_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, sinks_ptr, qk_scale, softcap_log2, sliding_window, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_bt,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, QUANTIZED: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_q = (tile - q_start // BLOCK_Q - seq) * BLOCK_Q  # this tile's first query, within the sequence
    if q_len <= 1 or first_q >= q_len:
        return
    context_len = tl.load(seq_lens_ptr + seq) - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = first_q + rows // GROUP_P
    head = kv_head * GROUP + rows % GROUP_P
    dims = tl.arange(0, HEAD_DIM_P)
    dim_mask = dims < HEAD_DIM
    head_mask = rows % GROUP_P < GROUP
    io_mask = ((q_idx < q_len) & head_mask)[:, None] & dim_mask[None, :]
    tokens = (q_start + q_idx).to(tl.int64)
    q = tl.load(query_ptr + tokens[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=io_mask, other=0.0)  # fmt: skip
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = context_len + q_idx  # position of each row's query in its sequence

    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    kv_end = context_len + tl.minimum(first_q + BLOCK_Q, q_len)  # the last query of the tile sees kv_end keys
    kv_start = 0
    if sliding_window > 0:
        # the first key the tile's first query sees
        kv_start = tl.maximum(context_len + first_q - sliding_window + 1, 0)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(kv_start, kv_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_mask = keys < kv_end
        k, v = load_kv_tiles(key_cache_ptr, value_cache_ptr, key_scale_ptr, value_scale_ptr, block_table_ptr,
                             kv_head, keys, key_mask, dims, dim_mask, stride_cb, stride_cs, stride_ch,
                             stride_sb, stride_ss, PAGE_SIZE, QUANTIZED)  # fmt: skip
        visible = (keys[None, :] <= q_pos[:, None]) & key_mask[None, :]
        if sliding_window > 0:
            visible = visible & (keys[None, :] > q_pos[:, None] - sliding_window)
        m_i, l_i, acc = online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, softcap_log2, DOT_PRECISION,
                                            SOFTCAP)  # fmt: skip

    acc = fold_sinks(sinks_ptr, head, head_mask, m_i, l_i, acc, HAS_SINKS)
    out_ptrs = out_ptr + tokens[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=io_mask)


def launch_prefill(
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
    tiles: PrefillTiles,
    upcast: bool,
) -> None:
    """Attention rows of the sequences with more than one query; inputs already checked by the caller
    (the key and value caches share strides, and so do the scales of a quantized cache, None otherwise)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    group_p = next_power_of_2(group)
    block_q = max(tiles.block_m // group_p, 1)
    num_seqs = seq_lens.shape[0]
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    quantized = key_scale is not None
    if not quantized:  # NOTE: the caches stand in for the scale pointers, which are never read
        key_scale, value_scale = key_cache, value_cache
    _prefill_kernel[grid](
        out, query, key_cache, value_cache, key_scale, value_scale, block_tables, query_start_loc, seq_lens,
        options.sinks_or(query), qk_scale, options.softcap_log2, options.sliding_window, num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), key_scale.stride(0), key_scale.stride(1),
        block_tables.stride(0),
        GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim, HEAD_DIM_P=max(next_power_of_2(head_dim), 16),
        PAGE_SIZE=key_cache.shape[1], BLOCK_Q=block_q, BLOCK_M=block_q * group_p, BLOCK_N=tiles.block_n,
        UPCAST=upcast, DOT_PRECISION="ieee" if query.dtype == torch.float32 else None, QUANTIZED=quantized,
        SOFTCAP=options.softcap > 0, HAS_SINKS=options.sinks is not None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
