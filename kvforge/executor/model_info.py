"""What the engine needs to know of the loaded model, without holding the model itself."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.layers.kv_cache_spec import LayerGroup
from kvforge.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The loaded model as the engine sees it: its name, vocabulary, context and KV cache footprint.

    Built by the worker of the engine's process (rank 0) once the model is loaded."""

    name: str  # the checkpoint folder or file
    hf_config: dict
    tokenizer: Tokenizer
    dtype: torch.dtype
    vocab_size: int
    max_model_len: int  # the longest sequence: max_model_len as configured, within the model's positions
    kv_bytes_per_token: int  # on this rank, all layers, in the KV cache dtype
    kv_cache_dtype: torch.dtype  # of the cache's values or codes
    device: torch.device
    attention_backend: str  # the backend the worker runs: "torch" or "triton"
    layer_groups: tuple[LayerGroup, ...]  # of the KV cache: one block table per request and group
