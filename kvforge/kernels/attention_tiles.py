"""Triton building blocks shared by the prefill and decode attention kernels.

A tile of keys (or values) is gathered from the paged cache through the sequence's block table:

    key index n ──► block_table[n // PAGE_SIZE] = block id b ──► cache[b, n % PAGE_SIZE, kv_head, :]

The block id is widened to int64 before it is multiplied by the block stride: a cache of a few
hundred thousand blocks already puts block * stride past 2**31.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.kernels.triton_compat import constexpr, jit, tl

LOG2E = 1.4426950408889634  # softmax runs on exp2: exp(x * scale) == exp2(x * scale * LOG2E)
LOG2E_IN_KERNEL = constexpr(LOG2E)
# NOTE: a finite floor instead of -inf keeps exp2(m_old - m_new) finite when a row saw no key yet.
NEG_BIG = constexpr(-1.0e38)


@dataclass(frozen=True, slots=True)
class AttentionOptions:
    """A layer's attention options as the kernels take them (see paged_attention.py): sliding_window (0: none),
    softcap (0: none), sinks [num_heads] (None: none)."""

    sliding_window: int = 0
    softcap: float = 0.0
    sinks: torch.Tensor | None = None

    @property
    def softcap_log2(self) -> float:
        return self.softcap * LOG2E

    def sinks_or(self, placeholder: torch.Tensor) -> torch.Tensor:
        """The sinks, or a tensor that stands in for their pointer (never read)."""
        return placeholder if self.sinks is None else self.sinks


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
    softcap_log2,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Fold one key tile into FlashAttention-2's running (max, sum, accumulator).

    q: [M, D] in the dtype of the dots; k, v: [N, D]; visible: [M, N] or [1, N] bool;
    m_i, l_i: [M] fp32 (log2 domain); acc: [M, D] fp32. Returns the updated (m_i, l_i, acc).
    SOFTCAP: scores s become c * tanh(s / c), with softcap_log2 = c * LOG2E (scores are in the log2 domain)."""
    # NOTE: k and v take q's dtype: fp32 when the kernel upcasts q (the interpreter's tl.dot is wrong on
    # bf16 operands), and the model dtype for tiles that a quantized cache gave back dequantized in fp32.
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if SOFTCAP:  # NOTE: tanh(x) = 1 - 2 / (exp(2x) + 1), which saturates to +-1 without overflow
        scores = softcap_log2 * (1.0 - 2.0 / (tl.exp2(scores / softcap_log2 * (2.0 * LOG2E_IN_KERNEL)) + 1.0))
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    p = tl.exp2(scores - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@jit
def fold_sinks(sinks_ptr, head, head_mask, m_i, l_i, acc, HAS_SINKS: tl.constexpr):
    """The output rows acc / l_i, with each head's sink logit (sinks_ptr[head], natural log domain) added to the
    softmax's denominator when HAS_SINKS: [M, D] fp32."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=head_mask, other=0.0).to(tl.float32) * LOG2E_IN_KERNEL
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha[:, None]
    return acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
