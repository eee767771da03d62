"""Zeroed host memory backed as it is written: zeros to read, and resident only where written (the CPU KV cache's
memory: a cache larger than what is served takes only what is served)."""

from __future__ import annotations

import psutil
import torch

from kvforge.layers.kv_cache_spec import KVCacheSpec
from kvforge.platforms.zeroed_memory import zeroed_tensor


def _rss() -> int:
    return psutil.Process().memory_info().rss


def test_zeros_resident_only_where_written() -> None:
    torch.zeros(2, 16, 8, 64, dtype=torch.float16)[1].eq(1.5).all()  # the ops below, once: their own first use
    before = _rss()
    cache = zeroed_tensor((4096, 16, 8, 64), torch.float16)  # 64 MiB
    assert cache.shape == (4096, 16, 8, 64) and cache.dtype == torch.float16 and cache.is_contiguous()
    cache[3].fill_(1.5)  # one block
    assert cache[3].eq(1.5).all() and not cache[4].any() and not cache[-1].any()
    assert _rss() - before < (8 << 20)
    cache.fill_(2.0)
    assert _rss() - before >= (60 << 20)


def test_a_cpu_kv_cache_is_zeros_resident_as_written() -> None:
    spec = KVCacheSpec(layer_shapes=(((8, 64), (8, 64)),) * 4)  # 4 layers of keys and values, 8 heads of 64
    before = _rss()
    caches = spec.allocate(num_blocks=1024, block_size=16, dtype=torch.float16, device=torch.device("cpu"))  # 128 MiB
    assert _rss() - before < (8 << 20)
    assert len(caches) == 4
    assert all(not tensor[block].any() for layer in caches for tensor in layer for block in (0, -1))  # zeros
