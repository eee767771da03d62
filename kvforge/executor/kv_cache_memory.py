"""Sizing the paged KV cache from a byte budget (bytes per token: the model's kv_cache_spec)."""

from __future__ import annotations

import torch

DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3


def kv_cache_budget(requested: int | None, device: torch.device, gpu_memory_utilization: float) -> int:
    """The byte budget: as requested, else 2 GiB on the CPU, else the free share of the GPU's memory
    after weights (and a margin for activations) are counted."""
    if requested is not None:
        return requested
    if device.type == "cpu":
        return DEFAULT_CPU_KV_CACHE_BYTES
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free - torch.cuda.memory_allocated(device)
    allowed = int(total * gpu_memory_utilization) - used_by_others - torch.cuda.memory_allocated(device)
    activation_margin = int(0.05 * total)
    return max(allowed - activation_margin, 0)


def num_blocks_for_budget(budget_bytes: int, block_size: int, bytes_per_token: int) -> int:
    """Blocks that fit the budget, counting the reserved null block; at least 2 are required."""
    num_blocks = budget_bytes // (block_size * bytes_per_token)
    if num_blocks < 2:
        raise ValueError(
            f"kv_cache_memory of {budget_bytes} bytes holds {num_blocks} blocks of {block_size} tokens "
            f"({bytes_per_token} bytes each); at least 2 are needed"
        )
    return num_blocks
