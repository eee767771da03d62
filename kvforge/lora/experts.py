"""The LoRA weights of one layer's routed experts (a FusedMoE): max_loras slots of zero-padded adapters for each
local expert, applied per (token, expert) pair by the token's slot inside the fused-MoE op (kernels/moe_lora.py).

    a13  [slots, experts, 2 * R, hidden]    rows 0..R: A of gate (or of the fused gate-up), rows R..2R: A of up
    b13  [slots, experts, 2 * inter, 2 * R]  B of gate into its inter rows and columns 0..R, of up into the
                                            next inter rows and columns R..2R; a fused gate-up B [2 * inter, r]
                                            takes every row and columns 0..r
    a2   [slots, experts, R, inter]         A of down
    b2   [slots, experts, hidden, R]        B of down

An adapter gives either one fused gate-up matrix per expert (PEFT's target_parameters on transformers' stacked
experts) or separate gate and up matrices (per-expert modules: experts.3.gate_proj, Mixtral's w1/w3); both fit.
R is max_lora_rank rounded up to 8 (16-byte rows for the CPU's grouped matmuls; the padding is zero).

Under tensor parallelism each rank holds the rows of gate and up, and the columns of A of down, of its share of
the intermediate dim (as the base experts are cut); under expert parallelism, its own experts whole.
"""

from __future__ import annotations

import torch
from torch import nn

from kvforge.kernels.moe_lora import ExpertLoRA
from kvforge.layers.moe import FusedMoE

# checkpoint matrix of an expert -> which part of the slots it fills (Mixtral names gate, up, down w1, w3, w2)
PIECES = {"gate_up_proj": "gate_up", "gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
          "down_proj": "down", "w2": "down"}
ExpertKey = tuple[int, str]  # (global expert index, checkpoint matrix name)


class ExpertLoRASlots(nn.Module):
    """Attached to a FusedMoE as `experts.lora`; `tensors(num_tokens)` is what its fused op reads.

    token_slots [max_tokens] is the pool's one buffer of per-row slot ids (as for the linear layers' slots)."""

    def __init__(self, experts: FusedMoE, max_loras: int, max_rank: int, token_slots: torch.Tensor,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.rank = -(-max_rank // 8) * 8
        self.num_experts = experts.num_experts
        self.first_expert, self.num_local_experts = experts.first_expert, experts.num_local_experts
        self.intermediate_size = experts.intermediate_size
        self.inter = slice(experts.inter_start, experts.inter_start + experts.local_intermediate)
        hidden, inter, rank = experts.gate_up_proj.shape[2], experts.local_intermediate, self.rank
        shape = (max_loras, self.num_local_experts)
        device = token_slots.device
        for name, size in (("a13", (2 * rank, hidden)), ("b13", (2 * inter, 2 * rank)), ("a2", (rank, inter)),
                           ("b2", (hidden, rank))):
            self.register_buffer(name, torch.zeros(*shape, *size, dtype=dtype, device=device))
        self.register_buffer("token_slots", token_slots, persistent=False)

    def full_shape(self, key: ExpertKey) -> tuple[int, int]:
        """(out_features, in_features) of the checkpoint matrix before any cutting."""
        hidden, inter = self.a13.shape[3], self.intermediate_size
        return {"gate_up": (2 * inter, hidden), "gate": (inter, hidden), "up": (inter, hidden),
                "down": (hidden, inter)}[PIECES[key[1]]]

    def local(self, key: ExpertKey, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This rank's share of a full (A [r, in], B [out, r]); None for another rank's expert."""
        if not 0 <= key[0] - self.first_expert < self.num_local_experts:
            return None
        piece = PIECES[key[1]]
        if piece == "gate_up":
            gate, up = b.chunk(2, dim=0)
            return a, torch.cat([gate[self.inter], up[self.inter]])
        if piece == "down":
            return a[:, self.inter], b
        return a, b[self.inter]

    def write(self, slot: int, pairs: dict[ExpertKey, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put an adapter's local (A, B) per expert matrix into slot (matrices it lacks stay zero)."""
        for buffer in (self.a13, self.b13, self.a2, self.b2):
            buffer[slot].zero_()
        inter = self.b13.shape[2] // 2
        for (expert, proj), (a, b) in pairs.items():
            local, rank, piece = expert - self.first_expert, a.shape[0], PIECES[proj]
            if piece == "down":
                self.a2[slot, local, :rank].copy_(a)
                self.b2[slot, local, :, :rank].copy_(b)
                continue
            first = self.rank if piece == "up" else 0
            rows = {"gate_up": slice(0, 2 * inter), "gate": slice(0, inter), "up": slice(inter, 2 * inter)}[piece]
            self.a13[slot, local, first : first + rank].copy_(a)
            self.b13[slot, local, rows, first : first + rank].copy_(b)

    def tensors(self, num_tokens: int) -> ExpertLoRA:
        return ExpertLoRA(self.a13, self.b13, self.a2, self.b2, self.token_slots[:num_tokens])
