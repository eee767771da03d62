"""Rotary position embedding applied in place of a copy to queries and keys."""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    # x: [num_tokens, num_heads, rot_dim]; cos/sin: [num_tokens, 1, rot_dim // 2]
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first rot_dim features of every head.

    positions: [num_tokens] int; query: [num_tokens, num_heads, head_dim];
    key: [num_tokens, num_kv_heads, head_dim]; cos_sin_cache: [max_position, rot_dim] fp32 with
    cos in the first half of the last dim and sin in the second. Computed in fp32.
    """
    rot_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    outs = []
    for x in (query, key):
        rotated = _rotate(x[..., :rot_dim].float(), cos, sin, is_neox).to(x.dtype)
        outs.append(rotated if rot_dim == x.shape[-1] else torch.cat((rotated, x[..., rot_dim:]), dim=-1))
    return outs[0], outs[1]
