"""Triton building blocks shared by the prefill and decode attention kernels.

A tile of keys (or values) is gathered from the paged cache through the sequence's block table:

    key index n ──► block_table[n // PAGE_SIZE] = block id b ──► cache[b, n % PAGE_SIZE, kv_head, :]

The block id is widened to int64 before it is multiplied by the block stride: a cache of a few
hundred thousand blocks already puts block * stride past 2**31.
"""

from __future__ import annotations

from kvforge.kernels.triton_compat import constexpr, jit, tl

LOG2E = 1.4426950408889634  # softmax runs on exp2: exp(x * scale) == exp2(x * scale * LOG2E)
# NOTE: a finite floor instead of -inf keeps exp2(m_old - m_new) finite when a row saw no key yet.
NEG_BIG = constexpr(-1.0e38)


@jit
def load_kv_tiles(
    key_cache_ptr,
    value_cache_ptr,
    key_scale_ptr,
    value_scale_ptr,
    block_table_ptr,
    kv_head,
    keys,
    key_mask,
    dims,
    dim_mask,
    stride_block,
    stride_slot,
    stride_head,
    stride_scale_block,
    stride_scale_slot,
    PAGE_SIZE: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    """Keys and values at positions `keys` [BLOCK_N] of one sequence (block_table_ptr: its row of the
    block table) and one KV head: two [BLOCK_N, HEAD_DIM_P] tiles, zero where masked. The key and
    value caches share one layout (strides), and so do their scales.

    QUANTIZED: the caches hold codes and the scale tensors [num_blocks, block_size, num_kv_heads] one
    scale per (token, head); the tiles come back dequantized in fp32 (online_softmax_step casts them)."""
    block_ids = tl.load(block_table_ptr + keys // PAGE_SIZE, mask=key_mask, other=0).to(tl.int64)
    slots = keys % PAGE_SIZE
    offsets = block_ids * stride_block + slots * stride_slot + kv_head * stride_head
    offsets = offsets[:, None] + dims[None, :]
    mask = key_mask[:, None] & dim_mask[None, :]
    k = tl.load(key_cache_ptr + offsets, mask=mask, other=0.0)
    v = tl.load(value_cache_ptr + offsets, mask=mask, other=0.0)
    if QUANTIZED:
        scale_offsets = block_ids * stride_scale_block + slots * stride_scale_slot + kv_head
        k_scale = tl.load(key_scale_ptr + scale_offsets, mask=key_mask, other=0.0)
        v_scale = tl.load(value_scale_ptr + scale_offsets, mask=key_mask, other=0.0)
        k = k.to(tl.float32) * k_scale[:, None]
        v = v.to(tl.float32) * v_scale[:, None]
    return k, v


@jit
def online_softmax_step(
    q,
    k,
    v,
    visible,
    m_i,
    l_i,
    acc,
    qk_scale,
    DOT_PRECISION: tl.constexpr,
):
    """Fold one key tile into FlashAttention-2's running (max, sum, accumulator).

    q: [M, D] in the dtype of the dots; k, v: [N, D]; visible: [M, N] or [1, N] bool;
    m_i, l_i: [M] fp32 (log2 domain); acc: [M, D] fp32. Returns the updated (m_i, l_i, acc)."""
    # NOTE: k and v take q's dtype: fp32 when the kernel upcasts q (the interpreter's tl.dot is wrong on
    # bf16 operands), and the model dtype for tiles that a quantized cache gave back dequantized in fp32.
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    p = tl.exp2(scores - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc
