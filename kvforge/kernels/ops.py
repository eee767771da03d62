"""The ops the model calls. Each name resolves to one implementation, picked once per process."""

from __future__ import annotations

from kvforge.kernels.activation import silu_and_mul_ref as silu_and_mul
from kvforge.kernels.cache_write import reshape_and_cache_ref as reshape_and_cache
from kvforge.kernels.paged_attention import paged_attention_ref as paged_attention
from kvforge.kernels.rms_norm import fused_add_rms_norm_ref as fused_add_rms_norm
from kvforge.kernels.rms_norm import rms_norm_ref as rms_norm
from kvforge.kernels.rotary import rotary_embedding_ref as rotary_embedding

__all__ = [
    "fused_add_rms_norm",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]
