"""Token embedding and LM head, with the vocabulary split over the tensor-parallel ranks.

The vocabulary is padded to a multiple of tp; rank r holds rows [r * V_local, (r + 1) * V_local):

    embedding   each rank looks up the ids in its range (zeros elsewhere); an all-reduce sums them
    LM head     each rank scores its rows; a gather concatenates the logits on the rank that samples
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.distributed.communicator import tp_all_reduce, tp_gather
from kvforge.distributed.parallel_state import get_parallel_state


class VocabParallelEmbedding(nn.Module):
    """weight [V_local, hidden]: this rank's rows of the (padded) vocabulary. Also serves as the LM head."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        state = get_parallel_state()
        self.parallel = state
        self.vocab_size = vocab_size
        self.tp_size = state.tp_size
        self.num_local = -(-vocab_size // state.tp_size)
        self.start = state.tp_rank * self.num_local
        self.weight = nn.Parameter(torch.empty(self.num_local, hidden_size), requires_grad=False)

    def load(self, tensor: torch.Tensor) -> None:
        """Copy this rank's rows of the full [vocab_size, hidden] checkpoint tensor."""
        if tuple(tensor.shape) != (self.vocab_size, self.weight.shape[1]):
            raise ValueError(f"embedding of shape {tuple(tensor.shape)}, expected "
                             f"{(self.vocab_size, self.weight.shape[1])}")
        rows = tensor[self.start : self.start + self.num_local]
        self.weight.data.zero_()
        self.weight.data[: rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.start
        outside = (local_ids < 0) | (local_ids >= self.num_local)
        x = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        return tp_all_reduce(self.parallel, x.masked_fill(outside[:, None], 0.0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """As the LM head: fp32 logits [num_tokens, vocab_size], gathered from every rank's rows on
        tensor-parallel index 0 (the rank that samples); None on the others."""
        logits = tp_gather(self.parallel, F.linear(hidden, self.weight).float())  # [num_tokens, V_local] each
        return None if logits is None else logits[:, : self.vocab_size]


