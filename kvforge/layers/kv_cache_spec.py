"""What a model keeps per token in the paged KV cache: the runner allocates it, the engine sizes it.

Every cache tensor of a layer is paged the same way, [num_blocks, block_size, *token_shape]:

    multi-head attention (Llama)   (key [num_kv_heads, head_dim], value [num_kv_heads, head_dim])
    latent attention (DeepSeek)    (latent [kv_lora_rank + qk_rope_head_dim],)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """layer_shapes[layer]: the per-token shape of each cache tensor of that layer."""

    layer_shapes: tuple[tuple[tuple[int, ...], ...], ...]

    def __post_init__(self) -> None:
        if not self.layer_shapes or not all(self.layer_shapes):
            raise ValueError(f"a KV cache spec needs at least one tensor per layer, got {self.layer_shapes}")
        for shapes in self.layer_shapes:
            if any(size < 1 for shape in shapes for size in shape):
                raise ValueError(f"KV cache tensor sizes must be >= 1, got {shapes}")

    @classmethod
    def key_value(cls, num_layers: int, num_kv_heads: int, head_dim: int) -> KVCacheSpec:
        """A key and a value cache of num_kv_heads x head_dim per layer."""
        per_head = (num_kv_heads, head_dim)
        return cls(((per_head, per_head),) * num_layers)

    @classmethod
    def latent(cls, num_layers: int, latent_dim: int) -> KVCacheSpec:
        """One row of latent_dim per token and layer, shared by every head (multi-head latent attention)."""
        return cls((((latent_dim,),),) * num_layers)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Cache bytes of one token across all layers."""
        return sum(math.prod(shape) for shapes in self.layer_shapes for shape in shapes) * dtype.itemsize

    def allocate(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> list[tuple[torch.Tensor, ...]]:
        """Zeroed cache tensors, one tuple per layer in the order of layer_shapes."""
        return [
            tuple(torch.zeros((num_blocks, block_size, *shape), dtype=dtype, device=device)
                  for shape in shapes)
            for shapes in self.layer_shapes
        ]
