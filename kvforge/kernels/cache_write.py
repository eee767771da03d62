"""Write new keys and values into the paged KV cache at the slots of the slot mapping."""

from __future__ import annotations

import torch


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value: [num_tokens, num_kv_heads, head_dim];
    key_cache/value_cache: [num_blocks, block_size, num_kv_heads, head_dim];
    slot_mapping: [num_tokens] int, slot = block_id * block_size + offset (negative: skip).

    Writes in place."""
    num_blocks, block_size = key_cache.shape[:2]
    flat_k = key_cache.view(num_blocks * block_size, *key_cache.shape[2:])
    flat_v = value_cache.view(num_blocks * block_size, *value_cache.shape[2:])
    slots = slot_mapping.long()
    flat_k[slots] = key.to(key_cache.dtype)
    flat_v[slots] = value.to(value_cache.dtype)
