"""What a hybrid model keeps per request for its linear-attention layers: a fixed-size state, not a cache per token.

A Gated DeltaNet layer (Qwen3-Next, Qwen3.5) keeps, per running request, the last conv_width - 1 inputs of its causal
conv1d and its delta-rule state. The runner allocates one slot of each per request the engine runs at once
(max_num_seqs); the KV cache manager's recurrent-state group gives a request its slot (engine/cache_groups.py):

    layer i:   conv_state   [num_slots, conv_channels, conv_width - 1]          (the model dtype)
               delta_state  [num_slots, num_heads, key_head_dim, value_head_dim] (float32: it carries the whole text)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DELTA_STATE_DTYPE = torch.float32


@dataclass(frozen=True, slots=True)
class RecurrentStateSpec:
    """layer_shapes[i]: (conv state shape, delta state shape) of one slot of linear-attention layer i."""

    layer_shapes: tuple[tuple[tuple[int, int], tuple[int, int, int]], ...]

    def __post_init__(self) -> None:
        if not self.layer_shapes:
            raise ValueError("a recurrent state spec needs at least one layer")
        for shapes in self.layer_shapes:
            if any(size < 1 for shape in shapes for size in shape):
                raise ValueError(f"recurrent state sizes must be >= 1, got {shapes}")

    @classmethod
    def gated_delta_net(cls, num_layers: int, conv_channels: int, conv_width: int, num_heads: int,
                        key_head_dim: int, value_head_dim: int) -> RecurrentStateSpec:
        """num_layers Gated DeltaNet layers of one shape (this rank's heads and channels)."""
        return cls((((conv_channels, conv_width - 1), (num_heads, key_head_dim, value_head_dim)),) * num_layers)

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        """One request's state across the layers (dtype: the model dtype, the conv state's)."""
        return sum(math.prod(conv) * dtype.itemsize + math.prod(delta) * DELTA_STATE_DTYPE.itemsize
                   for conv, delta in self.layer_shapes)

    def allocate(self, num_slots: int, dtype: torch.dtype, device: torch.device, copies: tuple[int, ...] = ()
                 ) -> list[tuple[torch.Tensor, ...]]:
        """Zeroed (conv_state, delta_state) per layer, [*copies, num_slots, ...]; a request's first step ignores what
        its slot held."""
        return [(torch.zeros((*copies, num_slots, *conv), dtype=dtype, device=device),
                 torch.zeros((*copies, num_slots, *delta), dtype=DELTA_STATE_DTYPE, device=device))
                for conv, delta in self.layer_shapes]
