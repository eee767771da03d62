"""Runs a pooling step: the whole inputs through the model without a KV cache, then the pooler."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from kvforge.kernels.cpu.extension import cpu_kernels
from kvforge.layers.attention import WholeSequenceMetadata
from kvforge.layers.pooler import PoolerConfig, pool, pooled_outputs
from kvforge.step_data import PoolingStep


class PoolingRunner:
    """Owns a pooling model: each step's flat batch of whole sequences, attended within each sequence (causal for a
    decoder), pooled, and turned into each request's embedding or class probabilities."""

    def __init__(self, model: nn.Module, pooler: PoolerConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.dtype = dtype
        self.pooler = pooler
        self.device = device
        self.no_kv_caches = [None] * model.config.num_layers
        self.classifier: nn.Module | None = getattr(model, "classifier", None)
        # attention on the flat batch through the C++ kernel, where it runs (else padded to the longest sequence)
        self.packed_attention = device.type == "cpu" and cpu_kernels() is not None

    @torch.inference_mode()
    def execute(self, step: PoolingStep) -> list[torch.Tensor]:
        """One float32 CPU tensor per request of the step, in its order."""
        lens = np.array([len(t) for t in step.token_ids], dtype=np.int64)
        starts = np.repeat(np.cumsum(lens) - lens, lens)
        positions = np.arange(int(lens.sum())) - starts  # [num_tokens]: each token's index in its input
        input_ids = np.fromiter((t for ids in step.token_ids for t in ids), dtype=np.int64, count=len(positions))
        metadata = WholeSequenceMetadata.build(lens.tolist(), self.model.is_causal, self.device, self.dtype,
                                              self.packed_attention)
        to_device = lambda a: torch.from_numpy(a).to(self.device, non_blocking=True)  # noqa: E731
        token_types = {}
        if self.model.takes_token_types:
            types = np.zeros(len(positions), dtype=np.int64)  # [num_tokens]
            for start, type_ids in zip(np.cumsum(lens) - lens, step.token_type_ids, strict=True):
                if type_ids is not None:
                    types[start:start + len(type_ids)] = type_ids
            token_types["token_type_ids"] = to_device(types)
        hidden = self.model(to_device(input_ids), to_device(positions), self.no_kv_caches, metadata, **token_types)
        pooled = pool(hidden, metadata.query_start_loc, self.pooler.pooling_type)
        return pooled_outputs(pooled, step.params, self.pooler, self.classifier)
