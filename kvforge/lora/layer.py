"""The LoRA weights of one linear layer: max_loras slots of zero-padded adapters, applied to every row of a step
by the row's slot (-1: none), in one shrink and one expand (kernels/lora.py).

A merged layer (QKV, gate-up) gives each of its S checkpoint matrices its own max_rank columns of the rank axis, so
one shrink serves them all; each matrix's B then expands its own columns into its own outputs:

    a     [slots, S * max_rank, in]        rows s * max_rank ...: A of checkpoint matrix s (zero past its rank);
          [slots, in, fused_width(...)]    A^T, where the op table fuses the whole update in one op
                                           (ops.lora_fused: the C++ CPU kernel, which adds into y in place)
    b_s   [slots, out_s, max_rank]         B of checkpoint matrix s (zero past its rank), one buffer per matrix;
          [slots, max_rank, out_s]         B^T, rank-major, where the op is fused

(the fused op's weights transposed: both of its products then run along their weights' contiguous axis). The slots
are of the engine's lora_dtype (lora/pool.py: slot_dtype), which may differ from the activations': the kernels widen
the weights as they read them.

Under tensor parallelism each rank holds its share, cut as the base weight is: a column-parallel layer's B by
output rows (each merged matrix on its own, as `shard_pieces` says), a row-parallel layer's A by input columns,
whose partial products the layer's one all-reduce sums with the base's.
"""

from __future__ import annotations

import torch
from torch import nn

from kvforge.kernels.lora import fused_width
from kvforge.kernels.ops import OpTable
from kvforge.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear


class LoRASlots(nn.Module):
    """Attached to a Linear as `linear.lora`; `forward(x, y)` returns y plus each row's adapter update.

    token_slots [max_tokens] is the pool's one buffer of per-row slot ids, written by the runner before each step
    (so a compiled step reads the new ids as an input and never recompiles)."""

    def __init__(self, linear: Linear, max_loras: int, max_rank: int, token_slots: torch.Tensor, ops: OpTable,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_kind = type(linear)
        self.max_rank = max_rank
        self.shard_sizes = list(linear.shard_sizes)
        self.shard_offsets = list(linear.shard_offsets)
        self.shard_pieces = getattr(linear, "shard_pieces", None)
        self.in_features = linear.in_features
        self.tp_size, self.tp_rank = getattr(linear, "tp_size", 1), getattr(linear, "tp_rank", 0)
        width = len(self.shard_sizes) * max_rank
        device = token_slots.device
        self.rank_major = ops.lora_fused is not None  # A and each B stored transposed, as the fused op reads them
        shape = ((max_loras, linear.in_features, fused_width(width)) if self.rank_major
                 else (max_loras, width, linear.in_features))
        self.register_buffer("a", torch.zeros(shape, dtype=dtype, device=device))
        for shard, size in enumerate(self.shard_sizes):
            shape = (max_loras, max_rank, size) if self.rank_major else (max_loras, size, max_rank)
            self.register_buffer(f"b{shard}", torch.zeros(shape, dtype=dtype, device=device))
        self.register_buffer("token_slots", token_slots, persistent=False)
        self.ops = ops

    def full_shape(self, shard: int) -> tuple[int, int]:
        """(out_features, in_features) of checkpoint matrix `shard` before tensor-parallel cutting."""
        out = self.shard_sizes[shard] * (self.shard_pieces[shard][0] if self.shard_pieces else 1)
        return out, self.in_features * (self.tp_size if issubclass(self.linear_kind, RowParallelLinear) else 1)

    def local(self, shard: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of a full (A [r, in], B [out, r]) of checkpoint matrix `shard`."""
        if issubclass(self.linear_kind, ColumnParallelLinear):
            _, index = self.shard_pieces[shard]
            size = self.shard_sizes[shard]
            return a, b.narrow(0, index * size, size)
        if issubclass(self.linear_kind, RowParallelLinear):
            return a.narrow(1, self.tp_rank * self.in_features, self.in_features), b
        return a, b

    def write(self, slot: int, pairs: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put an adapter's local (A, B) per checkpoint matrix into slot (matrices it lacks stay zero)."""
        self.a[slot].zero_()
        for shard in range(len(self.shard_sizes)):
            self.b_of(shard)[slot].zero_()
        for shard, (a, b) in pairs.items():
            rank, first = a.shape[0], shard * self.max_rank
            if self.rank_major:
                self.a[slot, :, first : first + rank].copy_(a.t())
                self.b_of(shard)[slot, :rank].copy_(b.t())
            else:
                self.a[slot, first : first + rank].copy_(a)
                self.b_of(shard)[slot, :, :rank].copy_(b)

    def b_of(self, shard: int) -> torch.Tensor:
        return getattr(self, f"b{shard}")

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        slots = self.token_slots[: x.shape[0]]  # [num_tokens]
        if self.rank_major:
            return self.ops.lora_fused(x, y, self.a, [self.b_of(s) for s in range(len(self.shard_sizes))], slots)
        h = self.ops.lora_shrink(x, self.a, slots)  # [num_tokens, S * max_rank]
        if len(self.shard_sizes) == 1:
            return self.ops.lora_expand(h, self.b0, slots, y)
        rank = self.max_rank
        return torch.cat([
            self.ops.lora_expand(h[:, s * rank : (s + 1) * rank], self.b_of(s), slots, y[:, offset : offset + size])
            for s, (offset, size) in enumerate(zip(self.shard_offsets, self.shard_sizes))], dim=1)
