"""Causal attention over a flat, ragged batch whose keys and values live in the paged KV cache.

One op serves every case: a fresh prefill, a prefill chunk after earlier chunks or a prefix-cache hit,
and a one-token decode. Sequence s owns query rows [query_start_loc[s], query_start_loc[s+1]); its
context holds seq_lens[s] tokens, the last q_len of which are the queries themselves:

    keys    0 1 2 3 4 5 6 7 8 9         seq_len = 10, q_len = 3, context_len = 7
    queries               q q q         query i sits at position context_len + i
                                        and sees keys 0 .. context_len + i
"""

from __future__ import annotations

import torch


def gather_kv(
    cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """cache: [num_blocks, block_size, num_kv_heads, head_dim]; block_tables: [num_seqs, max_blocks].

    Returns the first num_tokens cached tokens of each sequence: [num_seqs, num_tokens, kv_heads, dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    blocks = cache[block_tables[:, :num_blocks].long()]  # [S, nb, bs, Hkv, D]
    return blocks.flatten(1, 2)[:, :num_tokens]


def _attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """query: [S, Q, H, D]; key/value: [S, L, Hkv, D]; mask: [S, Q, L] bool (True = attend).

    Returns [S, Q, H, D]. Softmax in fp32."""
    num_seqs, q_len, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[2]
    group = num_heads // num_kv_heads
    q = query.float().view(num_seqs, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    k = key.float().permute(0, 2, 3, 1)  # [S, Hkv, D, L]
    v = value.float().transpose(1, 2)  # [S, Hkv, L, D]
    scores = torch.matmul(q.flatten(2, 3), k) * scale  # [S, Hkv, G*Q, L]
    scores = scores.view(num_seqs, num_kv_heads, group, q_len, -1)
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).flatten(2, 3)
    out = torch.matmul(probs, v).view(num_seqs, num_kv_heads, group, q_len, head_dim)
    return out.permute(0, 3, 1, 2, 4).reshape(num_seqs, q_len, num_heads, head_dim).to(query.dtype)


def paged_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """query: [num_tokens, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim];
    block_tables: [num_seqs, max_blocks] int32; query_start_loc: [num_seqs + 1] int32;
    seq_lens: [num_seqs] int32. Returns [num_tokens, num_heads, head_dim].

    One-token queries (decodes) are attended together as one padded batch; longer queries
    (prefill chunks) one sequence at a time."""
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
    decode_seqs = [s for s, n in enumerate(q_lens) if n == 1]
    if decode_seqs:
        idx = torch.tensor(decode_seqs, device=query.device)
        rows = torch.tensor([starts[s] for s in decode_seqs], device=query.device)
        dec_lens = seq_lens[idx].to(query.device)
        max_len = max(lens[s] for s in decode_seqs)
        k = gather_kv(key_cache, block_tables[idx], max_len)
        v = gather_kv(value_cache, block_tables[idx], max_len)
        mask = torch.arange(max_len, device=query.device)[None, None, :] < dec_lens[:, None, None]
        out[rows] = _attend(query[rows].unsqueeze(1), k, v, mask, scale).squeeze(1)
    for s, q_len in enumerate(q_lens):
        if q_len <= 1:
            continue
        seq_len = lens[s]
        k = gather_kv(key_cache, block_tables[s : s + 1], seq_len)
        v = gather_kv(value_cache, block_tables[s : s + 1], seq_len)
        q = query[starts[s] : starts[s + 1]].unsqueeze(0)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        mask = (torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]).unsqueeze(0)
        out[starts[s] : starts[s + 1]] = _attend(q, k, v, mask, scale).squeeze(0)
    return out


