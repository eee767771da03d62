"""From a step's hidden states to one output per sequence: pooling, then an embedding or class probabilities.

    hidden [num_tokens, hidden]  ──pool──►  [num_seqs, hidden]  ──► embed: first `dimensions` values, normalised
                                  cls: a sequence's first token     └─► classify / score: the classifier head's
                                  mean: the mean of its tokens           logits, softmax (one logit: sigmoid)
                                  last: its last token
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.pooling_params import PoolingParams

POOLING_TYPES = ("cls", "mean", "last")


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """How a checkpoint pools (read by loader/pooling_config.py): the pooling type, whether its embeddings are
    normalised, and the longest input it was trained on (None: its positions)."""

    pooling_type: str
    normalize: bool
    max_seq_length: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling type must be one of {POOLING_TYPES}, got {self.pooling_type!r}")


def pool(hidden: torch.Tensor, query_start_loc: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """One row per sequence of the flat batch: [num_seqs, hidden] in float32."""
    starts, ends = query_start_loc[:-1], query_start_loc[1:]
    if pooling_type == "cls":
        return hidden[starts].float()
    if pooling_type == "last":
        return hidden[ends - 1].float()
    # NOTE: a segment reduction; index_add_ of each token's row into its sequence's gave the same sums and took
    # 50-70x as long on the CPU (~115 ms at 64 sentences, 1900 tokens, 384 wide, 2 threads)
    return torch.segment_reduce(hidden.float(), "mean", lengths=ends - starts)


def pooled_outputs(pooled: torch.Tensor, params: list[PoolingParams], config: PoolerConfig,
                   classifier: nn.Module | None) -> list[torch.Tensor]:
    """Each sequence's output from its pooled row: an embedding, or class probabilities from the classifier."""
    outputs: list[torch.Tensor] = [pooled[i] for i in range(len(params))]
    heads = [i for i, p in enumerate(params) if p.task != "embed"]
    if heads:
        if classifier is None:
            raise ValueError("this model has no classifier head: it can only embed")
        logits = classifier(pooled[heads].to(_dtype(classifier))).float()  # [num_heads, num_labels]
        probs = logits.sigmoid() if logits.shape[1] == 1 else logits.softmax(dim=-1)
        for row, i in enumerate(heads):
            outputs[i] = probs[row]
    for i, p in enumerate(params):
        if p.task == "embed":
            vector = outputs[i][: p.dimensions]
            normalize = config.normalize if p.normalize is None else p.normalize
            outputs[i] = F.normalize(vector, dim=-1) if normalize else vector
    return [o.cpu() for o in outputs]


def _dtype(module: nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype
