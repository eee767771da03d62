"""Fused mixture-of-experts: every routed (token, expert) pair through its expert's gated MLP, weighted
by its routing weight and summed per token, in one pass over the experts.

    hidden [T, H] ─► pairs sorted by expert (moe_align) ─► grouped GEMM with w13 [E, 2I, H]
                  ─► silu(gate) * up ─► grouped GEMM with w2 [E, H, I], times the pair's routing weight
                  ─► sum of each token's top_k pairs

Three implementations with one contract: the readable reference (a loop over every expert, fp32), the
CPU path (pairs sorted by expert, two `grouped_mm` calls: no Python loop, no host sync) and the Triton
kernel (a grouped GEMM whose programs each own BLOCK_M rows of one expert). Each takes the experts' LoRA
slots (kernels/moe_lora.py), or None: a pair adds its adapter's update to both products. Experts whose weights are
kept in another layout (a GGUF file's blocks, packed for the panel kernel) run fused_moe_per_expert: each expert's
own multiplies on the tokens routed to it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from kvforge.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from kvforge.kernels.grouped_gemm import launch_grouped_gemm
from kvforge.kernels.lora import lora_expand_ref, lora_shrink_ref
from kvforge.kernels.moe_align import moe_align
from kvforge.kernels.moe_lora import (
    ExpertLoRA,
    add_expert_lora_grouped,
    add_expert_lora_ref,
    add_expert_lora_triton,
    check_expert_lora,
    grouped_lora_fits,
    pair_slots,
)
from kvforge.kernels.triton_compat import cdiv, require_triton
from kvforge.kernels.tuning import gemm_tiles
from kvforge.kernels.validation import FLOAT_DTYPES, INDEX_DTYPES, check_same_device, check_tensor
from kvforge.platforms import Platform


def fused_moe_ref(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    lora: ExpertLoRA | None = None,
) -> torch.Tensor:
    """hidden: [num_tokens, hidden]; w13: [num_experts, 2 * inter, hidden] ([gate | up] rows);
    w2: [num_experts, hidden, inter]; topk_weights: [num_tokens, top_k]; topk_ids: [num_tokens, top_k],
    -1 for a pair whose expert is not in w13/w2 (it contributes nothing).

    Returns sum_k topk_weights[t, k] * w2[e] @ (silu(gate) * up)(w13[e] @ hidden[t]), e = topk_ids[t, k]:
    [num_tokens, hidden], computed in fp32 one expert at a time. With lora, each product adds the update of
    the token's adapter for expert e (the plain LoRA reference over the expert's slots)."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    x = hidden.float()
    for expert in range(w13.shape[0]):
        tokens, top = (topk_ids == expert).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate_up = F.linear(x[tokens], w13[expert].float())
        if lora is not None:
            slots = lora.token_slots[tokens]
            a13, b13 = lora.a13[:, expert].float(), lora.b13[:, expert].float()
            gate_up = lora_expand_ref(lora_shrink_ref(x[tokens], a13, slots), b13, slots, gate_up)
        act = silu_and_mul_ref(gate_up)
        down = F.linear(act, w2[expert].float())
        if lora is not None:
            a2, b2 = lora.a2[:, expert].float(), lora.b2[:, expert].float()
            down = lora_expand_ref(lora_shrink_ref(act, a2, slots), b2, slots, down)
        out.index_add_(0, tokens, down * topk_weights[tokens, top, None].float())
    return out.to(hidden.dtype)


def fused_moe_per_expert(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up: Sequence[Callable[[torch.Tensor], torch.Tensor]],
    down: Sequence[Callable[[torch.Tensor], torch.Tensor]],
) -> torch.Tensor:
    """fused_moe_ref with expert e's products made by its own multiplies: gate_up[e](x [M, hidden]) -> [M, 2 * inter]
    ([gate | up] columns) and down[e](act [M, inter]) -> [M, hidden]. The pairs are sorted by expert and each
    expert's tokens gathered into one multiply (a host sync: the expert's token count)."""
    top_k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1).long()
    order = torch.argsort(ids, stable=True)  # pairs of other ranks' experts (-1) first
    valid = ids >= 0
    counts = torch.bincount(ids[valid], minlength=len(gate_up)).tolist()
    weights = topk_weights.reshape(-1).float()
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    start = ids.numel() - int(valid.sum())
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // top_k
        act = silu_and_mul_ref(gate_up[expert](hidden[tokens]))
        out.index_add_(0, tokens, down[expert](act).float() * weights[pairs, None])
    return out.to(hidden.dtype)


def _grouped_mm_fits(hidden: torch.Tensor, w2: torch.Tensor) -> bool:
    """F.grouped_mm (torch >= 2.9) needs 16-byte aligned row strides."""
    row_bytes = (hidden.shape[1] * hidden.element_size(), w2.shape[2] * w2.element_size())
    return hasattr(F, "grouped_mm") and all(n % 16 == 0 for n in row_bytes)


def fused_moe_cpu(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    lora: ExpertLoRA | None = None,
) -> torch.Tensor:
    """fused_moe_ref as two grouped matmuls over the pairs sorted by expert (the CPU path); the LoRA updates as two
    more each, over the pairs sorted by (adapter, expert).

    NOTE: measured on a 2-core CPU (benchmarks/RESULTS.md, "MoE (CPU)"): on par with one matmul pair per
    expert over the sorted pairs (which needs a host sync), 1.0-1.35x faster than the per-expert loop,
    and 3-20x faster than gathering each pair's expert weights for a bmm."""
    if torch.compiler.is_dynamo_compiling():  # NOTE: grouped_mm's fake implementation takes bfloat16 only
        return _gathered_moe(hidden, w13, w2, topk_weights, topk_ids, lora)
    if not (_grouped_mm_fits(hidden, w2) and (lora is None or grouped_lora_fits(lora))):
        return fused_moe_ref(hidden, w13, w2, topk_weights, topk_ids, lora)
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    ids = topk_ids.reshape(-1).long()
    valid = ids >= 0
    bucket = torch.where(valid, ids, num_experts)  # pairs of other ranks' experts sort last, in no group
    order = torch.argsort(bucket, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=ids.device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    group_ends = counts[:num_experts].cumsum(0).int()
    tokens = order // top_k
    x = hidden[tokens]  # [num_pairs, hidden], sorted by expert
    gate_up = F.grouped_mm(x, w13.transpose(1, 2), offs=group_ends)  # [num_pairs, 2 * inter]
    if lora is not None:
        slots = pair_slots(lora, topk_ids)[order]
        gate_up = add_expert_lora_grouped(gate_up, x, lora.a13, lora.b13, slots)
    act = silu_and_mul_ref(gate_up)
    down = F.grouped_mm(act, w2.transpose(1, 2), offs=group_ends)  # [num_pairs, hidden]
    if lora is not None:
        down = add_expert_lora_grouped(down, act, lora.a2, lora.b2, slots)
    # NOTE: rows past the last group are left unwritten by grouped_mm: masked, not multiplied by zero.
    down = down.masked_fill(~valid[order, None], 0.0) * topk_weights.reshape(-1)[order, None].to(down.dtype)
    return torch.zeros_like(hidden).index_add_(0, tokens, down)


def _gathered_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, lora: ExpertLoRA | None = None) -> torch.Tensor:
    """fused_moe_ref with each pair's expert weights gathered: no data-dependent shapes, so a compiled decode
    step (a few tokens, whose pairs read these weights anyway) traces it."""
    ids = topk_ids.long().clamp(min=0)
    weights = topk_weights.float() * (topk_ids >= 0)  # [T, k]; pairs of other ranks' experts count 0
    x = hidden.float()
    gate_up = torch.einsum("th,tkih->tki", x, w13[ids].float())  # [T, k, 2 * inter]
    if lora is not None:
        slots = pair_slots(lora, topk_ids)
        pairs = x.unsqueeze(1).expand(-1, ids.shape[1], -1).reshape(slots.shape[0], -1)  # [T * k, hidden]
        gate_up = add_expert_lora_ref(gate_up.flatten(0, 1), pairs, lora.a13, lora.b13, slots).view_as(gate_up)
    act = silu_and_mul_ref(gate_up)
    down = torch.einsum("tki,tkhi->tkh", act, w2[ids].float())  # [T, k, hidden]
    if lora is not None:
        down = add_expert_lora_ref(down.flatten(0, 1), act.flatten(0, 1), lora.a2, lora.b2, slots).view_as(down)
    return (down * weights[..., None]).sum(dim=1).to(hidden.dtype)


def _check_moe_inputs(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:  # fmt: skip
    check_tensor("hidden", hidden, shape=(None, None), dtypes=FLOAT_DTYPES)
    num_tokens, hidden_size = hidden.shape
    check_tensor("w13", w13, shape=(None, None, hidden_size), dtypes=(hidden.dtype,))
    num_experts, two_inter = w13.shape[:2]
    if two_inter % 2:
        raise ValueError(f"w13 must be [num_experts, 2 * inter, hidden], got {tuple(w13.shape)}")
    check_tensor("w2", w2, shape=(num_experts, hidden_size, two_inter // 2), dtypes=(hidden.dtype,))
    check_tensor("topk_ids", topk_ids, shape=(num_tokens, None), dtypes=INDEX_DTYPES)
    check_tensor("topk_weights", topk_weights, shape=tuple(topk_ids.shape), dtypes=FLOAT_DTYPES)
    check_same_device(hidden=hidden, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    if not (hidden.is_contiguous() and w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("hidden, w13 and w2 must be contiguous")


def fused_moe_triton(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    lora: ExpertLoRA | None = None,
    *,
    platform: Platform | None = None,
) -> torch.Tensor:
    """fused_moe_ref in Triton, with no host sync: moe_align, grouped GEMM (w13), silu_and_mul, grouped
    GEMM (w2) with the routing weights, then the sum over each token's top_k pairs in fp32. With lora, the
    LoRA kernels add each pair's update to the gate-up rows, and its weighted update to the down rows."""
    require_triton()
    _check_moe_inputs(hidden, w13, w2, topk_weights, topk_ids)
    if lora is not None:
        check_expert_lora(lora, hidden, w13)
    (num_tokens, hidden_size), (num_experts, top_k) = hidden.shape, (w13.shape[0], topk_ids.shape[1])
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(hidden)
    tiles = gemm_tiles(cdiv(num_pairs, num_experts), platform)  # rows per expert on an even routing
    sorted_pair_ids, block_expert_ids = moe_align(topk_ids, num_experts, tiles.block_m)
    # NOTE: zeroed: rows of pairs routed to other ranks' experts are never written, then still activated.
    gate_up = torch.zeros((num_pairs, w13.shape[1]), dtype=hidden.dtype, device=hidden.device)
    launch_grouped_gemm(gate_up, hidden, w13, None, sorted_pair_ids, block_expert_ids, top_k, tiles)
    if lora is not None:
        slots = pair_slots(lora, topk_ids)
        pairs = hidden.repeat_interleave(top_k, dim=0)  # [num_pairs, hidden]: pair p reads token p // top_k
        gate_up = add_expert_lora_triton(gate_up, pairs, lora.a13, lora.b13, slots, platform)
    act = silu_and_mul_triton(gate_up, platform=platform)
    down = torch.zeros((num_pairs, hidden_size), dtype=torch.float32, device=hidden.device)
    pair_weights = topk_weights.reshape(-1).float()
    launch_grouped_gemm(down, act, w2, pair_weights, sorted_pair_ids, block_expert_ids, 1, tiles)
    if lora is not None:
        update = add_expert_lora_triton(torch.zeros_like(down), act, lora.a2, lora.b2, slots, platform)
        down = down + update * pair_weights.unsqueeze(1)
    return down.view(num_tokens, top_k, hidden_size).sum(1).to(hidden.dtype)
