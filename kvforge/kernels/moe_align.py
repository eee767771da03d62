"""The `moe_align` step of fused MoE: (token, slot) pairs grouped by expert, each group padded to the GEMM
block size, so that every block of block_m rows belongs to exactly one expert.

With top_k = 2, pair p = token * top_k + slot. For block_m = 4 and experts [[0, 2], [0, 2], [2, 0]]:

    sorted pairs    0  2  5  P | 1  3  4  P | P  P  P  P     P = num_pairs: a padding row
    block experts        0     |     2      |    -1          -1: past the last expert, skipped

Pairs whose expert is -1 (an expert on another rank) are in no group. Everything is computed on the
device without a host sync; the sizes are bounds known from the shapes alone.
"""

from __future__ import annotations

import torch

from kvforge.kernels.triton_compat import cdiv


def max_aligned_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks that any routing of num_pairs pairs can fill: every non-empty expert (at most
    min(num_experts, num_pairs) of them) pads its group by fewer than block_m rows."""
    return cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids: [num_tokens, top_k] int, the expert of each pair (-1: none here).

    Returns sorted_pair_ids: [num_blocks * block_m] int32, the pairs grouped by expert in ascending
    order with padding rows equal to num_pairs; block_expert_ids: [num_blocks] int32, the expert of each
    block of block_m rows, -1 for the unused blocks at the end."""
    ids = topk_ids.reshape(-1).long()
    num_pairs = ids.numel()
    device = ids.device
    num_blocks = max_aligned_blocks(num_pairs, num_experts, block_m)
    bucket = torch.where(ids < 0, num_experts, ids)  # bucket num_experts: pairs without a local expert
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    # Where each bucket's group starts in the output; bucket num_experts goes to a dump row at the end.
    group_start = torch.cat((padded_end - padded, padded.new_full((1,), num_blocks * block_m)))
    order = torch.argsort(bucket, stable=True)
    sorted_bucket = bucket[order]
    rank_in_group = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_bucket]
    sorted_pair_ids = torch.full((num_blocks * block_m + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids[torch.minimum(group_start[sorted_bucket] + rank_in_group, group_start[-1])] = order.int()
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_expert_ids = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert_ids = torch.where(block_expert_ids < num_experts, block_expert_ids, -1).int()
    return sorted_pair_ids[:-1], block_expert_ids

