"""The CPU path of paged attention: C++ kernels that read the paged cache in place, else torch's fused
scaled_dot_product_attention on gathered blocks.

Same contract as `paged_attention_ref` (see paged_attention.py). With the C++ kernels (`cpu_kernels()`), decodes
(one query token) go through csrc/paged_decode.cpp and prefill chunks through csrc/paged_prefill.cpp, both reading
the cache's codes and scales in place. Without them, decodes of a step are attended in padded groups of similar
length with a length mask, and each prefill chunk on its own, with the plain causal mask when it has no earlier
context and an offset causal mask when it follows earlier chunks or cached blocks; a quantized cache (codes +
scales) is dequantized to the query dtype as its blocks are gathered. A sliding window is one more mask there; a soft
cap or sinks, which fused attention has no place for, take the reference (paged_attention_ref) without the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvforge.kernels.attention_tiles import AttentionOptions
from kvforge.kernels.cpu.extension import cpu_kernels
from kvforge.kernels.paged_attention import gather_kv, paged_attention_ref


@dataclass(frozen=True, slots=True)
class _PagedKV:
    """One layer's key and value caches, with their scales when they hold quantized codes."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    key_scale: torch.Tensor | None
    value_scale: torch.Tensor | None

    def gather(self, block_tables: torch.Tensor, num_tokens: int, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the first num_tokens tokens: [num_seqs, num_tokens, kv_heads, dim] each."""
        return (gather_kv(self.key_cache, block_tables, num_tokens, self.key_scale, dtype),
                gather_kv(self.value_cache, block_tables, num_tokens, self.value_scale, dtype))


# Decodes are sorted by context length and attended in groups of this many, so that padding each
# group to its longest context wastes little memory traffic.
DECODE_GROUP = 16


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
          mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    """query: [S, Q, H, D]; key/value: [S, L, Hkv, D]; mask broadcastable to [S, 1, Q, L]. -> [S, Q, H, D]."""
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
    )
    return out.transpose(1, 2)


def _decode_group(out: torch.Tensor, query: torch.Tensor, kv: _PagedKV, block_tables: torch.Tensor,
                  starts: list[int], lens: list[int], seqs: list[int], scale: float, window: int) -> None:
    """One-token queries of sequences of similar length, attended as one padded batch."""
    rows = torch.tensor([starts[s] for s in seqs])
    tables = block_tables[seqs]
    max_len = lens[seqs[-1]]
    key, value = kv.gather(tables, max_len, query.dtype)
    seq_lens = torch.tensor([lens[s] for s in seqs])
    positions = torch.arange(max_len)[None, :]
    mask = positions < seq_lens[:, None]
    if window > 0:
        mask &= positions >= seq_lens[:, None] - window
    mask = mask[:, None, None, :]  # [B, 1, 1, L]
    out[rows] = _sdpa(query[rows].unsqueeze(1), key, value, scale, mask=mask).squeeze(1)


def _decode_native(out: torch.Tensor, query: torch.Tensor, kv: _PagedKV, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor, starts: list[int], seqs: list[int], scale: float,
                   options: AttentionOptions) -> None:
    """All one-token queries through the C++ kernel, which reads the cache (codes and scales) in place."""
    extra = (kv.key_scale, kv.value_scale, options.sliding_window, options.softcap, options.sinks)
    if len(seqs) == len(starts) - 1:  # a decode-only step: rows are sequences, in order
        out.copy_(paged_decode_cpu(query, kv.key_cache, kv.value_cache, block_tables, seq_lens, scale, *extra))
        return
    rows = torch.tensor([starts[s] for s in seqs])
    out[rows] = paged_decode_cpu(query[rows], kv.key_cache, kv.value_cache, block_tables[seqs], seq_lens[seqs],
                                 scale, *extra)


def paged_decode_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence through the C++ kernel (needs cpu_kernels()): query [num_seqs, num_heads,
    head_dim] -> [num_seqs, num_heads, head_dim]; a sequence of length 0 (a padding row) gives zeros."""
    return torch.ops.kvforge_cpu.paged_decode(query.contiguous(), key_cache, value_cache, block_tables.contiguous(),
                                              seq_lens.contiguous(), scale, key_scale, value_scale, sliding_window,
                                              softcap, sinks)


def paged_prefill_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of every sequence with more than one query token through the C++ kernel (needs
    cpu_kernels()): query [num_tokens, num_heads, head_dim] -> the same shape, the rows of one-token sequences left
    unwritten."""
    return torch.ops.kvforge_cpu.paged_prefill(query.contiguous(), key_cache, value_cache, block_tables.contiguous(),
                                               query_start_loc.contiguous(), seq_lens.contiguous(), scale, key_scale,
                                               value_scale, sliding_window, softcap, sinks)


def paged_attention_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """query: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]."""
    options = AttentionOptions(sliding_window, softcap, sinks)
    kv = _PagedKV(key_cache, value_cache, key_scale, value_scale)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode_seqs = [s for s in range(len(lens)) if starts[s + 1] - starts[s] == 1]
    if cpu_kernels() is not None:
        if len(decode_seqs) < len(lens):
            out = paged_prefill_cpu(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
                                    key_scale, value_scale, sliding_window, softcap, sinks)
        else:
            out = torch.empty_like(query)
        if decode_seqs:
            _decode_native(out, query, kv, block_tables, seq_lens, starts, decode_seqs, scale, options)
        return out
    if softcap > 0 or sinks is not None:
        return paged_attention_ref(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
                                   key_scale, value_scale, sliding_window, softcap, sinks)
    out = torch.empty_like(query)
    decode_seqs.sort(key=lens.__getitem__)
    for first in range(0, len(decode_seqs), DECODE_GROUP):
        _decode_group(out, query, kv, block_tables, starts, lens, decode_seqs[first : first + DECODE_GROUP], scale,
                      sliding_window)
    for s, seq_len in enumerate(lens):
        q_len = starts[s + 1] - starts[s]
        if q_len == 1:
            continue
        key, value = kv.gather(block_tables[s : s + 1], seq_len, query.dtype)
        query_rows = query[starts[s] : starts[s + 1]].unsqueeze(0)
        if q_len == seq_len and sliding_window == 0:
            out[starts[s] : starts[s + 1]] = _sdpa(query_rows, key, value, scale, causal=True)[0]
        else:
            q_pos = torch.arange(seq_len - q_len, seq_len)
            mask = torch.arange(seq_len)[None, :] <= q_pos[:, None]  # [Q, L]
            if sliding_window > 0:
                mask &= torch.arange(seq_len)[None, :] > q_pos[:, None] - sliding_window
            out[starts[s] : starts[s + 1]] = _sdpa(query_rows, key, value, scale, mask=mask)[0]
    return out
