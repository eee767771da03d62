"""Token embedding and LM head, with the vocabulary split over the tensor-parallel ranks.

The vocabulary is padded to a multiple of tp; rank r holds rows [r * V_local, (r + 1) * V_local):

    embedding   each rank looks up the ids in its range (zeros elsewhere); an all-reduce sums them
    LM head     each rank scores its rows; a gather concatenates the logits on the rank that samples

The rows may stay quantized as the checkpoint stores them (`keep_kernel`, given by quantization/vocab_rows.py, e.g. a
GGUF file's Q8_0 embedding): the head then runs through the weight-only GEMV, and a lookup dequantizes only the rows
it gathers.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.distributed.communicator import tp_all_reduce, tp_gather
from kvforge.distributed.parallel_state import get_parallel_state
from kvforge.kernels.cpu.dense_gemv import dense_linear
from kvforge.layers.linear_kernel import LinearKernel, WeightArena


class RowKernel(LinearKernel, Protocol):
    """A kernel that also gathers rows of its weight (an embedding lookup that dequantizes only those rows)."""

    def gather_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows W[ids] [len(ids), K] float32."""
        ...


class VocabParallelEmbedding(nn.Module):
    """weight [V_local, hidden]: this rank's rows of the (padded) vocabulary. Also serves as the LM head."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        state = get_parallel_state()
        self.parallel = state
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.tp_size = state.tp_size
        self.num_local = -(-vocab_size // state.tp_size)
        self.start = state.tp_rank * self.num_local
        self.weight = nn.Parameter(torch.empty(self.num_local, hidden_size, dtype=dtype), requires_grad=False)
        self.kernel: RowKernel | None = None  # the rows kept quantized, in place of weight
        self.weight_arena: WeightArena | None = None  # where the kernel's packed rows go (set by the loader)
        self.dense_gemv = False  # the float head's rows through the CPU GEMV and oneDNN (set at load)
        self.onednn_weight: torch.Tensor | None = None  # the weight packed for oneDNN (set with dense_gemv)
        self.dtype = dtype  # of the rows looked up (the weight may be kept in 16 bits, or quantized)

    def load(self, tensor: torch.Tensor) -> None:
        """Copy this rank's rows of the full [vocab_size, hidden] checkpoint tensor."""
        if tuple(tensor.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(f"embedding of shape {tuple(tensor.shape)}, expected "
                             f"{(self.vocab_size, self.hidden_size)}")
        rows = tensor[self.start : self.start + self.num_local]
        self.weight.data.zero_()
        self.weight.data[: rows.shape[0]].copy_(rows)

    def local_rows(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows [V_local, ...] of a tensor over the whole vocabulary [vocab_size, ...], padding rows
        zero."""
        pad = self.start + self.num_local - self.vocab_size
        local = full[self.start : self.start + self.num_local]
        return local if pad <= 0 else torch.cat([local, local.new_zeros(min(pad, self.num_local), *full.shape[1:])])

    def keep_kernel(self, kernel: RowKernel) -> None:
        """Replace the float weight with kernel, holding this rank's rows [V_local, hidden] (quantized)."""
        self.dtype = self.weight.dtype
        del self.weight
        self.kernel = kernel

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            return F.embedding(ids, self.weight).to(self.dtype)
        return self.kernel.gather_rows(ids).to(self.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        local_ids = input_ids - self.start
        outside = (local_ids < 0) | (local_ids >= self.num_local)
        x = self._lookup(local_ids.masked_fill(outside, 0))
        return tp_all_reduce(self.parallel, x.masked_fill(outside[:, None], 0.0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """As the LM head: fp32 logits [num_tokens, vocab_size], gathered from every rank's rows on
        tensor-parallel index 0 (the rank that samples); None on the others."""
        if self.kernel is None:
            local = dense_linear(hidden, self.weight, None, self.dense_gemv, self.onednn_weight)
        else:
            local = self.kernel.apply(hidden)
        logits = tp_gather(self.parallel, local.float())  # [num_tokens, V_local] each
        return None if logits is None else logits[:, : self.vocab_size]


