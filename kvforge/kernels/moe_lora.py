"""LoRA of routed experts: each (token, expert) pair adds the update of its token's adapter for that expert, to the
gate-up product (before the activation) and to the down product (before the routing weight).

    a13 [S, E, R13, H]   b13 [S, E, 2I, R13]     gate-up:  gate_up[p] += x[t] @ a13[s, e]^T @ b13[s, e]^T
    a2  [S, E, R2, I]    b2  [S, E, H, R2]       down:     down[p]    += act[p] @ a2[s, e]^T @ b2[s, e]^T
    token_slots [T]      s = token_slots[t] (-1: no adapter), e = topk_ids[t, k] (-1: another rank's expert)

A pair's adapter is the pair of indices (s, e); flattened to one index s * E + e ("pair slot", -1 for none) over the
slots' weights viewed as [S * E, R, K], it is the per-row slot of the plain batched LoRA (kernels/lora.py), so:

    reference   the plain LoRA reference, one expert at a time, with each token's slot (fused_moe_ref)
    CPU         two grouped matmuls over the pairs sorted by pair slot: each group one (adapter, expert)
    Triton      the plain LoRA kernels (one program per row) over the pairs with their pair slots
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvforge.kernels.lora import lora_expand_ref, lora_expand_triton, lora_shrink_ref, lora_shrink_triton
from kvforge.kernels.validation import FLOAT_DTYPES, INDEX_DTYPES, check_same_device, check_tensor
from kvforge.platforms import Platform


class ExpertLoRA(NamedTuple):
    """The LoRA slots of one layer's local experts (zero past each adapter's rank) and each token's slot."""

    a13: torch.Tensor  # [slots, experts, R13, hidden]
    b13: torch.Tensor  # [slots, experts, 2 * inter, R13]
    a2: torch.Tensor  # [slots, experts, R2, inter]
    b2: torch.Tensor  # [slots, experts, hidden, R2]
    token_slots: torch.Tensor  # [num_tokens]


def pair_slots(lora: ExpertLoRA, topk_ids: torch.Tensor) -> torch.Tensor:
    """[num_tokens * top_k] pair slot s * E + e of each pair (token-major), -1 without an adapter or a local expert."""
    num_experts = lora.a13.shape[1]
    slots = lora.token_slots.long().unsqueeze(1)  # [T, 1]
    ids = topk_ids.long()
    return torch.where((slots >= 0) & (ids >= 0), slots * num_experts + ids, -1).reshape(-1)


def add_expert_lora_ref(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                        slots: torch.Tensor) -> torch.Tensor:
    """y [P, N] + each row's update: x [P, K] @ a[slot]^T @ b[slot]^T, a [S, E, R, K], b [S, E, N, R], slots [P] pair
    slots; each row's adapter gathered (fp32 accumulation). Traces into a compiled step: no data-dependent shape."""
    a, b = a.flatten(0, 1), b.flatten(0, 1)
    return lora_expand_ref(lora_shrink_ref(x, a, slots), b, slots, y)


def add_expert_lora_grouped(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                            slots: torch.Tensor) -> torch.Tensor:
    """add_expert_lora_ref as two grouped matmuls over the rows sorted by pair slot (one group per adapter and
    expert, rows without one sorted last, in no group); no host sync. Needs F.grouped_mm's 16-byte row strides."""
    num_groups = a.shape[0] * a.shape[1]
    bucket = torch.where(slots >= 0, slots, num_groups)
    order = torch.argsort(bucket, stable=True)
    counts = torch.zeros(num_groups + 1, dtype=torch.long, device=slots.device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    group_ends = counts[:num_groups].cumsum(0).int()
    h = F.grouped_mm(x[order], a.flatten(0, 1).transpose(1, 2), offs=group_ends)  # [P, R]
    delta = F.grouped_mm(h, b.flatten(0, 1).transpose(1, 2), offs=group_ends)  # [P, N]
    # NOTE: rows past the last group are left unwritten by grouped_mm: masked, not multiplied by zero.
    delta = delta.masked_fill((bucket[order] == num_groups).unsqueeze(1), 0.0)
    return y.index_add(0, order, delta.to(y.dtype))


def grouped_lora_fits(lora: ExpertLoRA) -> bool:
    """Whether add_expert_lora_grouped may run: F.grouped_mm needs 16-byte row strides of every operand."""
    return hasattr(F, "grouped_mm") and all(t.shape[-1] * t.element_size() % 16 == 0 for t in lora[:4])


def add_expert_lora_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                           slots: torch.Tensor, platform: Platform | None = None) -> torch.Tensor:
    """add_expert_lora_ref with the Triton shrink and expand kernels (a new tensor of y's dtype) on platform's tiles
    (None: the current platform's)."""
    h = lora_shrink_triton(x, a.flatten(0, 1), slots, platform=platform)
    return lora_expand_triton(h, b.flatten(0, 1), slots, y, platform=platform)


def check_expert_lora(lora: ExpertLoRA, hidden: torch.Tensor, w13: torch.Tensor) -> None:
    """The slots' shapes against the layer's (hidden [T, H], w13 [E, 2I, H]), before a kernel reads them."""
    (num_tokens, hidden_size), (num_experts, two_inter) = hidden.shape, w13.shape[:2]
    check_tensor("lora a13", lora.a13, shape=(None, num_experts, None, hidden_size), dtypes=FLOAT_DTYPES)
    num_slots, _, rank13, _ = lora.a13.shape
    check_tensor("lora b13", lora.b13, shape=(num_slots, num_experts, two_inter, rank13), dtypes=(lora.a13.dtype,))
    check_tensor("lora a2", lora.a2, shape=(num_slots, num_experts, None, two_inter // 2), dtypes=(lora.a13.dtype,))
    check_tensor("lora b2", lora.b2, shape=(num_slots, num_experts, hidden_size, lora.a2.shape[2]),
                 dtypes=(lora.a13.dtype,))
    check_tensor("lora token_slots", lora.token_slots, shape=(num_tokens,), dtypes=INDEX_DTYPES)
    check_same_device(hidden=hidden, **lora._asdict())
    if not all(t.is_contiguous() for t in lora[:4]):
        raise ValueError("the expert LoRA slots (a13, b13, a2, b2) must be contiguous")
