"""Attention over the paged KV cache, and the per-step metadata it reads."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvforge.kernels.ops import current_ops


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step on the CPU and copied to the device once; passed explicitly to every layer.

    The batch is flat: sequence s owns token rows [query_start_loc[s], query_start_loc[s + 1]).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new key/value is written
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: context length including this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with the null block
    # every sequence has one query token (rows are sequences): attention takes the decode kernel
    decode_only: bool = False
    # with several layer groups in the KV cache (KVCacheSpec.layer_groups): groups 1..'s (slot_mapping, block_tables)
    other_groups: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    # with linear-attention layers (a recurrent-state group): each sequence's state slot, and whether it continues
    # from the state there (a later chunk or a decode) or starts from zeros (its first step)
    state_slot_ids: torch.Tensor | None = None  # [num_seqs] int32
    has_initial_state: torch.Tensor | None = None  # [num_seqs] bool
    # a step with drafts to verify: per position j, (rows of the sequences' j-th tokens, those sequences' indices)
    verification_rows: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None

    def of_group(self, group_id: int) -> AttentionMetadata:
        """The metadata that the layers of a group of the KV cache read (their own block tables and slots)."""
        if group_id == 0:
            return self
        slot_mapping, block_tables = self.other_groups[group_id - 1]
        return AttentionMetadata(slot_mapping, self.query_start_loc, self.seq_lens, block_tables, self.decode_only)


@dataclass(slots=True)
class WholeSequenceMetadata:
    """A step of whole sequences and no KV cache (pooling models): each sequence attends among its own tokens,
    all of them (encoders) or those up to each query (decoders, causal).

    Sequences of different lengths are gathered into padded rows once per layer:

        token_rows  [num_seqs, max_len]  flat row of each sequence's token j (0 past the sequence's end)
        valid_rows  [num_tokens]  where each token of the flat batch is in the padded rows, flattened (s * max_len + j)
        mask        [num_seqs, 1, max_len, max_len]  added to the scores: 0 where query i may see key j, -inf
                                         elsewhere (padding queries see key 0 onwards, so no row is empty; their
                                         outputs are dropped), in the model's dtype

    Sequences of one length (one sequence, say) are a view of the flat batch: token_rows, valid_rows and mask are
    None. So are they when the step is `packed`: on the CPU with its C++ kernels, attention runs on the flat batch
    itself, sequence by sequence (csrc/varlen_attention.cpp: no padding, no mask).
    """

    query_start_loc: torch.Tensor  # [num_seqs + 1] int64
    num_seqs: int
    causal: bool
    token_rows: torch.Tensor | None = None
    valid_rows: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    packed: bool = False

    @classmethod
    def build(cls, seq_lens: list[int], causal: bool, device: torch.device, dtype: torch.dtype,
              packed: bool = False) -> WholeSequenceMetadata:
        """packed: attend on the flat batch with the CPU kernel (the runner says so where it has it)."""
        lens = np.asarray(seq_lens, dtype=np.int64)
        starts = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=starts[1:])
        to_device = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
        metadata = cls(to_device(starts), len(lens), causal, packed=packed)
        if packed or (lens == lens[0]).all():
            return metadata
        columns = np.arange(int(lens.max()))
        valid = columns[None, :] < lens[:, None]
        mask = np.broadcast_to(valid[:, None, None, :], (len(lens), 1, len(columns), len(columns)))
        if causal:
            mask = mask & (columns[None, :] <= columns[:, None])[None, None]
        metadata.token_rows = to_device(np.where(valid, starts[:-1, None] + columns[None, :], 0))
        # NOTE: additive, once a step: SDPA turned a boolean mask into this in every layer (~9% of a BERT step)
        additive = torch.zeros(mask.shape, dtype=dtype).masked_fill_(torch.from_numpy(~mask), float("-inf"))
        metadata.valid_rows, metadata.mask = to_device(np.flatnonzero(valid)), additive.to(device)
        return metadata


class Attention(nn.Module):
    """Writes this step's keys and values into the layer's cache, then attends over the cache; with no cache
    (kv_cache None, a pooling step's WholeSequenceMetadata) attends within each sequence of the step.

    Per layer: sliding_window (0: every earlier token), softcap of the scores (0: none), scale (head_dim ** -0.5 by
    default), sinks (GPT-OSS: a learned logit per head in the softmax's denominator, `sinks` [num_heads] float32,
    loaded as a parameter) and cache_group, the layer group of the KV cache whose block tables the layer reads."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, *, sliding_window: int = 0,
                 softcap: float = 0.0, scale: float | None = None, use_sinks: bool = False,
                 cache_group: int = 0) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.sinks = (nn.Parameter(torch.zeros(num_heads, dtype=torch.float32), requires_grad=False)
                      if use_sinks else None)
        self.cache_group = cache_group
        self.ops = current_ops()

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: tuple[torch.Tensor, ...] | None,
        metadata: AttentionMetadata | WholeSequenceMetadata,
    ) -> torch.Tensor:
        """kv_cache: (key_cache, value_cache) in the model dtype, or (key codes, value codes, key scales,
        value scales) for a quantized cache (see KVCacheSpec); None in a pooling step."""
        if kv_cache is None:
            return self._whole_sequences(query, key, value, metadata)
        metadata = metadata.of_group(self.cache_group)
        key_cache, value_cache, *scales = kv_cache
        key_scale, value_scale = scales or (None, None)
        self.ops.reshape_and_cache(key, value, key_cache, value_cache, metadata.slot_mapping, *scales)
        attend = self.ops.paged_decode if metadata.decode_only else self.ops.paged_attention
        return attend(
            query, key_cache, value_cache, metadata.block_tables, metadata.query_start_loc, metadata.seq_lens,
            self.scale, key_scale, value_scale, self.sliding_window, self.softcap, self.sinks,
        )

    def _whole_sequences(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         metadata: WholeSequenceMetadata) -> torch.Tensor:
        """Attention within each sequence of the step, packed or padded to the longest: [num_tokens, num_heads,
        head_dim]."""
        if metadata.packed:  # NOTE: 2.7x faster than padding, at 64 sentences of 10-44 tokens (1 thread)
            return torch.ops.kvforge_cpu.varlen_attention(query, key, value, metadata.query_start_loc, self.scale,
                                                          metadata.causal)
        rows = metadata.token_rows
        if rows is None:  # [num_seqs, heads, seq_len, head_dim], a view
            padded = [t.view(metadata.num_seqs, -1, *t.shape[1:]).transpose(1, 2) for t in (query, key, value)]
        else:  # [num_seqs, heads, max_len, head_dim], gathered in one index_select of the three side by side
            # NOTE: a row index of each of q, k, v (strided views of one qkv output) took 2-3x as long as this
            parts = (query, key, value)
            packed = _side_by_side(parts)
            gathered = packed.index_select(0, rows.flatten()).view(*rows.shape, -1)
            widths = [t.shape[1] * t.shape[2] for t in parts]
            padded = [piece.view(*rows.shape, *t.shape[1:]).transpose(1, 2)
                      for piece, t in zip(gathered.split(widths, dim=2), parts, strict=True)]
        out = F.scaled_dot_product_attention(*padded, attn_mask=metadata.mask, scale=self.scale,
                                             is_causal=metadata.causal and metadata.mask is None,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        if rows is None:
            return out.transpose(1, 2).reshape(query.shape[0], self.num_heads, -1)
        # NOTE: an index_select of precomputed rows; a boolean mask of the valid ones waited on its nonzero()
        return out.transpose(1, 2).reshape(-1, *out.shape[1::2]).index_select(0, metadata.valid_rows)


def _side_by_side(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Tensors [num_tokens, heads, head_dim] as one [num_tokens, total width]: a view where they are adjacent
    slices of each row of one buffer (a merged qkv projection's output), else a copy.
    NOTE: the copy (torch.cat) of a merged projection's q, k, v took ~10% of a BERT pooling step"""
    first = parts[0]
    width = sum(t.shape[1] * t.shape[2] for t in parts)
    offset, row_stride = first.storage_offset(), first.stride(0)
    for t in parts:
        if (t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or t.storage_offset() != offset
                or t.stride() != (row_stride, t.shape[2], 1) or row_stride < width):
            return torch.cat([t.reshape(t.shape[0], -1) for t in parts], dim=1)
        offset += t.shape[1] * t.shape[2]
    return first.as_strided((first.shape[0], width), (row_stride, 1))
