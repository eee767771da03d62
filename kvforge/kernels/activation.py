"""SiLU-and-multiply: the gated activation of Llama-style MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * d] holding [gate | up]; returns silu(gate) * up: [num_tokens, d]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
