"""What a model keeps per token in the paged KV cache: the runner allocates it, the engine sizes it.

Every cache tensor of a layer is paged the same way, [num_blocks, block_size, *token_shape]:

    multi-head attention (Llama)   (key [num_kv_heads, head_dim], value [num_kv_heads, head_dim])
    latent attention (DeepSeek)    (latent [kv_lora_rank + qk_rope_head_dim],)

Values are stored in value_dtype (the model dtype when None; 16 bits on the CPU by default, which the attention kernels
widen to float as they read). A quantized cache (code_dtype int8 or fp8, see kernels/kv_quant.py) stores each tensor
as codes and adds
one float32 scale per row of the last dim, in a tensor of the shape without it, after the codes:

    multi-head attention, int8     (key codes, value codes, key scales [num_kv_heads], value scales [num_kv_heads])

Layers that keep different things per request (full attention, a sliding window) form layer groups, each with its own
block table per request in the one pool of blocks (see engine/cache_groups.py). Groups hold equally many layers, so a
block is the same size in every group: layer slot s of every group shares one cache tensor, and a block id belongs to
one group at a time. Gemma 3's 5 local to 1 global layers of 12 layers (L: local, G: global):

    layers        L0 L1 L2 L3 L4 G5 L6 L7 L8 L9 L10 G11
    groups (2)    full [G5 G11]   window [L0 L1] [L2 L3] [L4 L6] [L7 L8] [L9 L10]
    slot tensors  slot 0: G5 L0 L2 L4 L7 L9    slot 1: G11 L1 L3 L6 L8 L10
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from kvforge.kernels.kv_quant import SCALE_DTYPE, kv_code_dtype
from kvforge.layers.recurrent_state_spec import RecurrentStateSpec
from kvforge.platforms import Platform
from kvforge.platforms.zeroed_memory import zeroed_tensor

_VALUE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers that share one block table per request: kind "full_attention", "sliding_window" (of sliding_window
    tokens) or "recurrent_state" (a state slot per request, no blocks); layers[s]: the layer in slot s (groups of a
    kind whose layer count is not a multiple of the group size leave the last group's tail slots empty)."""

    kind: str
    layers: tuple[int, ...]
    sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """layer_shapes[layer]: the per-token shape of each cache tensor of that layer; code_dtype: None to
    store values (in value_dtype, or the model dtype), or the dtype of quantized codes (with scales beside them)."""

    layer_shapes: tuple[tuple[tuple[int, ...], ...], ...]
    code_dtype: torch.dtype | None = None
    value_dtype: torch.dtype | None = None
    quantizable: bool = True  # whether the model's attention reads a quantized cache
    # per layer: its sliding window in tokens (None: full attention); None: every layer attends to every token
    layer_windows: tuple[int | None, ...] | None = None
    # a hybrid model's linear-attention layers, after the paged layers in the model's list of caches
    recurrent_state: RecurrentStateSpec | None = None

    def __post_init__(self) -> None:
        if not self.layer_shapes or not all(self.layer_shapes):
            raise ValueError(f"a KV cache spec needs at least one tensor per layer, got {self.layer_shapes}")
        for shapes in self.layer_shapes:
            if any(size < 1 for shape in shapes for size in shape):
                raise ValueError(f"KV cache tensor sizes must be >= 1, got {shapes}")
        if self.layer_windows is not None:
            if len(self.layer_windows) != len(self.layer_shapes):
                raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for "
                                 f"{len(self.layer_shapes)} layers")
            if any(w is not None and w < 1 for w in self.layer_windows):
                raise ValueError(f"sliding windows must be >= 1 token, got {self.layer_windows}")

    def layer_groups(self) -> tuple[LayerGroup, ...]:
        """The layer groups of the KV cache: one full-attention group of every layer unless layers of different
        windows (of the same per-token shapes) allow the blocks they no longer read to be freed."""
        windows = self.layer_windows or (None,) * len(self.layer_shapes)
        kinds: dict[int | None, list[int]] = {}
        for layer, window in enumerate(windows):
            kinds.setdefault(window, []).append(layer)
        if len(kinds) == 1 or len(set(self.layer_shapes)) > 1:
            return (LayerGroup("full_attention", tuple(range(len(windows)))),)
        size = min(len(layers) for layers in kinds.values())
        # NOTE: full attention first: group 0 is the one that bounds a request's length
        return tuple(LayerGroup("full_attention" if window is None else "sliding_window", tuple(layers[i : i + size]),
                                window)
                     for window, layers in sorted(kinds.items(), key=lambda kind: kind[0] is not None)
                     for i in range(0, len(layers), size))

    def cache_groups(self) -> tuple[LayerGroup, ...]:
        """Every group of the KV cache manager: the paged layer groups, then the recurrent-state group of a hybrid
        model's linear-attention layers (their caches follow the paged layers' in the runner's list)."""
        groups = self.layer_groups()
        if self.recurrent_state is None:
            return groups
        first = len(self.layer_shapes)
        num_layers = len(self.recurrent_state.layer_shapes)
        return (*groups, LayerGroup("recurrent_state", tuple(range(first, first + num_layers))))

    def layer_group_ids(self) -> list[int]:
        """The group of each layer."""
        group_of = [0] * len(self.layer_shapes)
        for group_id, group in enumerate(self.layer_groups()):
            for layer in group.layers:
                group_of[layer] = group_id
        return group_of

    @classmethod
    def key_value(cls, num_layers: int, num_kv_heads: int, head_dim: int) -> KVCacheSpec:
        """A key and a value cache of num_kv_heads x head_dim per layer."""
        per_head = (num_kv_heads, head_dim)
        return cls(((per_head, per_head),) * num_layers)

    @classmethod
    def latent(cls, num_layers: int, latent_dim: int) -> KVCacheSpec:
        """One row of latent_dim per token and layer, shared by every head (multi-head latent attention)."""
        # NOTE: the latent cache is already ~10x smaller than keys and values; MLA reads it unquantized.
        return cls((((latent_dim,),),) * num_layers, quantizable=False)

    def with_kv_cache_dtype(self, kv_cache_dtype: str, dtype: torch.dtype, widening: bool = False,
                            platform: Platform | None = None) -> KVCacheSpec:
        """This spec stored as kv_cache_dtype for a model run in dtype: "auto" (float16 where the attention kernels
        widen cached rows as they read them, `widening`: the CPU's, where a float32 cache doubles the bytes every
        decode step reads; else the model dtype), "float32" / "float16" / "bfloat16" (with widening kernels, or the
        model dtype), "int8" or "fp8" (platform's fp8: the engine's, None for the current platform's)."""
        code_dtype = kv_code_dtype(kv_cache_dtype, platform)
        value_dtype = _VALUE_DTYPES.get(kv_cache_dtype)
        if kv_cache_dtype == "auto":
            value_dtype = torch.float16 if widening and self.quantizable else dtype
        if (code_dtype is not None or value_dtype != dtype) and not self.quantizable:
            raise ValueError(
                f"kv_cache_dtype={kv_cache_dtype!r} (--kv-cache-dtype) is not supported by this model's "
                f"latent attention (MLA) cache; use kv_cache_dtype='auto'"
            )
        if value_dtype not in (None, dtype) and not widening:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: the Triton attention kernels (GPUs) read a cache "
                             f"in the model dtype ({dtype}, kv_cache_dtype='auto'), int8 or fp8")
        return replace(self, code_dtype=code_dtype, value_dtype=None if code_dtype is not None else value_dtype)

    def _layer_tensors(self, shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype
                       ) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(per-token shape, dtype) of each tensor of one layer, in allocation order."""
        if self.code_dtype is None:
            return [(shape, self.value_dtype or dtype) for shape in shapes]
        return [(shape, self.code_dtype) for shape in shapes] + [(shape[:-1], SCALE_DTYPE) for shape in shapes]

    def _layer_bytes(self, shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype) -> int:
        return sum(math.prod(shape) * tensor_dtype.itemsize
                   for shape, tensor_dtype in self._layer_tensors(shapes, dtype))

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Cache bytes of one token slot of a block (dtype: the model dtype), scales included: every layer's, or with
        several layer groups the layers of one group (a block belongs to one group at a time)."""
        groups = self.layer_groups()
        if len(groups) == 1:
            return sum(self._layer_bytes(shapes, dtype) for shapes in self.layer_shapes)
        return len(groups[0].layers) * self._layer_bytes(self.layer_shapes[0], dtype)

    def allocate(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> list[tuple[torch.Tensor, ...]]:
        """Zeroed cache tensors, one tuple per layer in the order of layer_shapes (then their scales). NOTE: on the
        CPU in zeroed_memory, resident as blocks are first written: a cache that serves fewer tokens than it holds
        does not take its whole size (a 256 MiB cache serving one 256-token sequence of a 1B model: ~8 MiB)."""
        def zeros(shape: tuple[int, ...], tensor_dtype: torch.dtype) -> torch.Tensor:
            if device.type == "cpu":
                return zeroed_tensor(shape, tensor_dtype)
            return torch.zeros(shape, dtype=tensor_dtype, device=device)

        groups = self.layer_groups()
        if len(groups) == 1:
            return [tuple(zeros((num_blocks, block_size, *shape), tensor_dtype)
                          for shape, tensor_dtype in self._layer_tensors(shapes, dtype))
                    for shapes in self.layer_shapes]
        slots = [tuple(zeros((num_blocks, block_size, *shape), tensor_dtype)
                       for shape, tensor_dtype in self._layer_tensors(self.layer_shapes[0], dtype))
                 for _ in groups[0].layers]
        caches: list[tuple[torch.Tensor, ...]] = [()] * len(self.layer_shapes)
        for group in groups:
            for slot, layer in enumerate(group.layers):
                caches[layer] = slots[slot]
        return caches


def layer_windows(hf_config: dict, default_pattern: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: global), from layer_types or the sliding_window_pattern of config.json."""
    num_layers, window = hf_config["num_hidden_layers"], hf_config.get("sliding_window")
    types = hf_config.get("layer_types")
    if types is None:
        pattern = hf_config.get("sliding_window_pattern", default_pattern)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types must name sliding_attention or full_attention for each of the {num_layers} "
                         f"layers, got {types}")
    if window is None and "sliding_attention" in types:
        raise ValueError("config.json names sliding_attention layers but no sliding_window")
    return tuple(window if kind == "sliding_attention" else None for kind in types)
