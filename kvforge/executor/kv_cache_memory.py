"""Sizing the paged KV cache: what the engine's sequences need, within a byte budget and the memory free.

    needed      max_num_seqs x ceil(max_model_len / block_size) blocks, plus the reserved null block
    budget      2 GiB on the CPU; on a GPU, gpu_memory_utilization x its memory less what is in use
    free        on the CPU, the memory this process may still take (loader/memory_fit.py) less a working set
    num_blocks  kv_cache_memory // block bytes, when kv_cache_memory is given (the size asked for)
                else the smallest of needed, budget and free; the engine's log names the one that chose it

So a tiny model's cache is the MBs its sequences can fill (the tests' 2-layer Llama: 256 x 512 tokens, 32 MiB), and
a model whose sequences need more than the budget (the default model: 256 x 8192 tokens, 48 GB) gets the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.loader.memory_fit import WORKING_SET, available_memory

DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3


def blocks_needed(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """Blocks that max_num_seqs sequences of max_model_len tokens fill, and the reserved null block."""
    return max_num_seqs * -(-max_model_len // block_size) + 1


@dataclass(frozen=True, slots=True)
class KVCacheSize:
    """The cache's blocks (the null block included) and what set their number, in words for the log; and the most
    requests that may run at once (max_num_seqs, or fewer where a hybrid model's state slots would not fit)."""

    num_blocks: int
    limit: str
    max_num_seqs: int


def memory_limits(device: torch.device, gpu_memory_utilization: float) -> list[tuple[str, int]]:
    """The byte limits of a cache sized by default on device, each with what it is."""
    if device.type == "cpu":
        free = max(available_memory() - WORKING_SET, 0)
        return [(f"the CPU's default budget of {DEFAULT_CPU_KV_CACHE_BYTES / 2**30:g} GiB (--kv-cache-memory)",
                 DEFAULT_CPU_KV_CACHE_BYTES),
                (f"the memory free ({free / 2**20:.0f} MiB beyond a working set)", free)]
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    used_by_others = total - free - allocated
    activation_margin = int(0.05 * total)
    allowed = int(total * gpu_memory_utilization) - used_by_others - allocated - activation_margin
    return [(f"{gpu_memory_utilization:.0%} of the GPU's memory (--gpu-memory-utilization) less the weights, "
             f"activations and other processes", max(allowed, 0))]


def size_kv_cache(requested: int | None, max_num_seqs: int, max_model_len: int, block_size: int,
                  bytes_per_token: int, limits: list[tuple[str, int]]) -> KVCacheSize:
    """Blocks of the cache: as many as requested bytes hold, or by default what max_num_seqs sequences of
    max_model_len tokens need within every (what, bytes) of limits. At least 2 blocks (one and the null block)."""
    block_bytes = block_size * bytes_per_token
    if requested is not None:
        choices = [(requested // block_bytes, f"kv_cache_memory={requested} bytes (--kv-cache-memory)")]
    else:
        needed = blocks_needed(max_num_seqs, max_model_len, block_size)
        choices = [(needed, f"the need of {max_num_seqs} sequences of {max_model_len} tokens (--max-num-seqs, "
                            f"--max-model-len)")]
        choices += [(num_bytes // block_bytes, what) for what, num_bytes in limits]
    num_blocks, limit = min(choices, key=lambda choice: choice[0])
    if num_blocks < 2:
        raise ValueError(f"the KV cache holds {num_blocks} blocks of {block_size} tokens ({bytes_per_token} bytes a "
                         f"token) within {limit}; at least 2 are needed")
    return KVCacheSize(num_blocks, limit, max_num_seqs)
