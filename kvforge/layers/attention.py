"""Attention over the paged KV cache, and the per-step metadata it reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch
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


class Attention(nn.Module):
    """Writes this step's keys and values into the layer's cache, then attends over the cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.ops = current_ops()

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: tuple[torch.Tensor, ...],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """kv_cache: (key_cache, value_cache) in the model dtype, or (key codes, value codes, key scales,
        value scales) for a quantized cache (see KVCacheSpec)."""
        key_cache, value_cache, *scales = kv_cache
        self.ops.reshape_and_cache(key, value, key_cache, value_cache, metadata.slot_mapping, *scales)
        attend = self.ops.paged_decode if metadata.decode_only else self.ops.paged_attention
        return attend(
            query, key_cache, value_cache, metadata.block_tables,
            metadata.query_start_loc, metadata.seq_lens, self.scale, *scales,
        )
