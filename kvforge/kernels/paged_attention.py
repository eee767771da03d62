"""Causal attention over a flat, ragged batch whose keys and values live in the paged KV cache.

One op serves every case: a fresh prefill, a prefill chunk after earlier chunks or a prefix-cache hit,
and a one-token decode. Sequence s owns query rows [query_start_loc[s], query_start_loc[s+1]); its
context holds seq_lens[s] tokens, the last q_len of which are the queries themselves:

    keys    0 1 2 3 4 5 6 7 8 9         seq_len = 10, q_len = 3, context_len = 7
    queries               q q q         query i sits at position context_len + i
                                        and sees keys 0 .. context_len + i

Three per-layer options, off by default:
    sliding_window W > 0   the query at position p sees keys p - W + 1 .. p only (W = 4: query 9 sees 6 7 8 9)
    softcap c > 0          scores become c * tanh(score / c) before the softmax (Gemma 2)
    sinks [num_heads]      a learned logit per head that joins the softmax's denominator and no value (GPT-OSS):
                           out = sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j))
"""

from __future__ import annotations

import math

import torch

from kvforge.kernels.attention_tiles import LOG2E, AttentionOptions
from kvforge.kernels.decode_attention import launch_decode
from kvforge.kernels.kv_quant import CODE_DTYPES, check_triton_code_dtype, dequantize_kv
from kvforge.kernels.prefill_attention import launch_prefill
from kvforge.kernels.triton_compat import INTERPRETED, next_power_of_2, require_triton
from kvforge.kernels.tuning import kernel_tuning
from kvforge.kernels.validation import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_kv_scales,
    check_matches,
    check_same_device,
    check_same_dtype,
    check_tensor,
)
from kvforge.platforms import Platform, current_platform

MAX_HEAD_DIM = 256


def gather_kv(
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    num_tokens: int,
    scales: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """cache: [num_blocks, block_size, num_kv_heads, head_dim] (contiguous);
    block_tables: [num_seqs, max_blocks]; scales: [num_blocks, block_size, num_kv_heads] when the cache
    holds quantized codes, whose values then come back as dtype.

    Returns the first num_tokens cached tokens of each sequence: [num_seqs, num_tokens, kv_heads, dim].
    NOTE: index_select over whole blocks is several times faster on the CPU than advanced indexing."""
    if scales is not None:
        return dequantize_kv(gather_kv(cache, block_tables, num_tokens),
                             gather_kv(scales, block_tables, num_tokens), dtype)  # fmt: skip
    num_seqs = block_tables.shape[0]
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    block_ids = block_tables[:, :num_blocks].reshape(-1).long()
    blocks = cache.view(cache.shape[0], -1).index_select(0, block_ids)
    if cache.dtype in (torch.float16, torch.bfloat16) and cache.dtype != dtype:  # 16-bit values, float32 queries
        blocks = blocks.to(dtype)
    return blocks.view(num_seqs, num_blocks * block_size, *cache.shape[2:])[:, :num_tokens]


def _attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float,
    softcap: float = 0.0, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """query: [S, Q, H, D]; key/value: [S, L, Hkv, D]; mask: [S, Q, L] bool (True = attend); sinks: [H].

    Returns [S, Q, H, D]. Softmax in fp32."""
    num_seqs, q_len, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[2]
    group = num_heads // num_kv_heads
    q = query.float().view(num_seqs, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    k = key.float().permute(0, 2, 3, 1)  # [S, Hkv, D, L]
    v = value.float().transpose(1, 2)  # [S, Hkv, L, D]
    scores = torch.matmul(q.flatten(2, 3), k) * scale  # [S, Hkv, G*Q, L]
    scores = scores.view(num_seqs, num_kv_heads, group, q_len, -1)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    if sinks is not None:  # one more logit per head, whose value is zero
        sink = sinks.float().view(1, num_kv_heads, group, 1, 1).expand(num_seqs, -1, -1, q_len, 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    probs = (probs[..., :-1] if sinks is not None else probs).flatten(2, 3)
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
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """query: [num_tokens, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim];
    block_tables: [num_seqs, max_blocks] int32; query_start_loc: [num_seqs + 1] int32;
    seq_lens: [num_seqs] int32. Returns [num_tokens, num_heads, head_dim].
    key_scale/value_scale: [num_blocks, block_size, num_kv_heads] float32 when the caches hold int8 or fp8
    codes (see kv_quant.py), None otherwise. sliding_window, softcap, sinks: see the module docstring.

    One-token queries (decodes) are attended together as one padded batch; longer queries
    (prefill chunks) one sequence at a time."""
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]
    decode_seqs = [s for s, n in enumerate(q_lens) if n == 1]
    if decode_seqs:
        idx = torch.tensor(decode_seqs, device=query.device)
        rows = torch.tensor([starts[s] for s in decode_seqs], device=query.device)
        dec_lens = seq_lens[idx].to(query.device)
        max_len = max(lens[s] for s in decode_seqs)
        k = gather_kv(key_cache, block_tables[idx], max_len, key_scale)
        v = gather_kv(value_cache, block_tables[idx], max_len, value_scale)
        positions = torch.arange(max_len, device=query.device)[None, None, :]
        mask = positions < dec_lens[:, None, None]
        if sliding_window > 0:
            mask &= positions > dec_lens[:, None, None] - 1 - sliding_window
        out[rows] = _attend(query[rows].unsqueeze(1), k, v, mask, scale, softcap, sinks).squeeze(1)
    for s, q_len in enumerate(q_lens):
        if q_len <= 1:
            continue
        seq_len = lens[s]
        k = gather_kv(key_cache, block_tables[s : s + 1], seq_len, key_scale)
        v = gather_kv(value_cache, block_tables[s : s + 1], seq_len, value_scale)
        q = query[starts[s] : starts[s + 1]].unsqueeze(0)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        positions = torch.arange(seq_len, device=query.device)[None, :]
        mask = positions <= q_pos[:, None]
        if sliding_window > 0:
            mask &= positions > q_pos[:, None] - sliding_window
        out[starts[s] : starts[s + 1]] = _attend(q, k, v, mask.unsqueeze(0), scale, softcap, sinks).squeeze(0)
    return out


def _check_attention_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    key_scale: torch.Tensor | None,
    value_scale: torch.Tensor | None,
) -> None:
    check_tensor("query", query, shape=(None, None, None), dtypes=FLOAT_DTYPES)
    num_heads, head_dim = query.shape[1:]
    check_tensor("key_cache", key_cache, shape=(None, None, None, head_dim), dtypes=FLOAT_DTYPES + CODE_DTYPES)
    check_tensor("value_cache", value_cache, shape=tuple(key_cache.shape), dtypes=(key_cache.dtype,))
    if check_kv_scales(key_cache, key_scale, value_scale):
        check_same_device(key_cache=key_cache, key_scale=key_scale, value_scale=value_scale)
    else:
        check_same_dtype(query=query, key_cache=key_cache, value_cache=value_cache)
    if key_cache.stride() != value_cache.stride():
        raise ValueError(
            f"key_cache and value_cache must share strides, "
            f"got {key_cache.stride()} and {value_cache.stride()}"
        )
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    check_tensor("seq_lens", seq_lens, shape=(None,), dtypes=INDEX_DTYPES)
    check_tensor("query_start_loc", query_start_loc, shape=(num_seqs + 1,), dtypes=INDEX_DTYPES)
    check_tensor("block_tables", block_tables, shape=(num_seqs, None), dtypes=INDEX_DTYPES)
    check_same_device(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
    )
    num_kv_heads = key_cache.shape[2]
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite float, got {scale}")


def attention_options(query: torch.Tensor, sliding_window: int, softcap: float, sinks: torch.Tensor | None
                      ) -> AttentionOptions:
    """The checked options: a window of >= 0 tokens, a softcap >= 0, float32 sinks [num_heads] on the query's device."""
    if sliding_window < 0:
        raise ValueError(f"sliding_window must be >= 0 (0: none), got {sliding_window}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be a finite float >= 0 (0: none), got {softcap}")
    if sinks is not None:
        check_tensor("sinks", sinks, shape=(query.shape[1],), dtypes=(torch.float32,))
        check_same_device(query=query, sinks=sinks)
    return AttentionOptions(sliding_window, softcap, sinks)


def paged_attention_triton(
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
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    platform: Platform | None = None,
) -> torch.Tensor:
    """paged_attention_ref in Triton, with no host sync (CUDA-graph safe). Sequences with one query go
    to the flash-decoding kernel, longer ones to the prefill kernel; a batch whose token count equals
    its sequence count holds only decodes and skips the prefill launch.

    out: a preallocated [num_tokens, num_heads, head_dim] buffer; num_splits: override the number of
    key-range splits of the decode kernel (default: from the tuning table and the device size)."""
    require_triton()
    _check_attention_inputs(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
                            key_scale, value_scale)
    options = attention_options(query, sliding_window, softcap, sinks)
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    check_matches("out", out, shape=query.shape, dtype=query.dtype, device=query.device, contiguous=True)
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    num_tokens, num_seqs = query.shape[0], seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    platform = platform if platform is not None else current_platform()  # whose tiles (None: the current one's)
    check_triton_code_dtype(key_cache.dtype, platform)
    tuning = kernel_tuning(platform)
    upcast = INTERPRETED and query.dtype == torch.bfloat16
    args = (out, query, key_cache, value_cache, key_scale, value_scale, block_tables, query_start_loc, seq_lens,
            scale * LOG2E, options)
    if num_tokens > num_seqs:
        padded_head_dim = next_power_of_2(query.shape[2])
        launch_prefill(*args, tiles=tuning.prefill_tiles(padded_head_dim), upcast=upcast)
    if num_splits is None:
        num_splits = tuning.decode.num_splits(num_seqs, key_cache.shape[2], platform.num_compute_units)
    launch_decode(*args, tiles=tuning.decode, num_splits=num_splits, upcast=upcast)
    return out
