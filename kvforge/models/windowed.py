"""What the families of local (sliding-window) and global attention layers share (Gemma 2 / 3, GPT-OSS): each layer's
window from config.json, each layer's group of the KV cache, and the cache spec that keeps local layers in groups of
their own (KVCacheSpec.layer_windows), so that a local layer keeps only its window's blocks.

Mixed into a decoder-stack model class, before it:

    class Gemma2ForCausalLM(WindowedLayersMixin, LlamaForCausalLM): ...
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from kvforge.layers.attention import Attention
from kvforge.layers.kv_cache_spec import KVCacheSpec, layer_windows


class WindowedLayersMixin:
    """Call init_windows(hf_config) before the stack's __init__ builds the layers; build each layer's attention with
    windowed_attention."""

    window_pattern: ClassVar[int] = 2  # one global layer in this many (when config.json has no layer_types)
    windows: tuple[int | None, ...]
    start_layer: int
    end_layer: int
    config: Any
    stage_layers: nn.ModuleList

    def init_windows(self, hf_config: dict) -> None:
        self.windows = layer_windows(hf_config, self.window_pattern)

    @property
    def stage_windows(self) -> tuple[int | None, ...]:
        return self.windows[self.start_layer : self.end_layer]

    def windowed_attention(self, layer_idx: int, num_heads: int, num_kv_heads: int, **kwargs: Any) -> Attention:
        """Layer layer_idx's Attention over this rank's heads: its window (if local) and its layer group of the KV
        cache; kwargs go to Attention (scale, softcap, use_sinks)."""
        # the layer group of each of this stage's layers (every layer keeps the same per-token shape)
        spec = KVCacheSpec((((1,),),) * len(self.stage_windows), layer_windows=self.stage_windows)
        group_ids = spec.layer_group_ids()
        return Attention(num_heads, num_kv_heads, self.config.head_dim, sliding_window=self.windows[layer_idx] or 0,
                         cache_group=group_ids[layer_idx - self.start_layer], **kwargs)  # fmt: skip

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """Keys and values per layer, local layers in groups of their own (see KVCacheSpec.layer_groups)."""
        num_kv_heads = self.stage_layers[0].self_attn.attn.num_kv_heads
        per_head = (num_kv_heads, self.config.head_dim)
        return KVCacheSpec(((per_head, per_head),) * len(self.stage_layers), layer_windows=self.stage_windows)
