"""Block pool and KV cache manager with hand-made requests: ref counts, prefix hits, LRU eviction."""

from __future__ import annotations

import pytest

from kvforge.engine.block_pool import NULL_BLOCK_ID, BlockPool
from kvforge.engine.kv_cache_manager import KVCacheManager
from kvforge.engine.request import Request
from kvforge.sampling_params import SamplingParams


def _request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=8))


def test_pool_never_hands_out_the_null_block_and_counts_refs():
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.allocate(4)
    assert NULL_BLOCK_ID not in blocks and pool.num_free_blocks == 0
    pool.touch(blocks[:1])
    pool.free(blocks)
    assert pool.num_free_blocks == 3  # blocks[0] still has one reference
    pool.free(blocks[:1])
    assert pool.num_free_blocks == 4
    with pytest.raises(AssertionError):
        pool.free(blocks[:1])


def test_pool_rejects_a_cache_without_room():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1, enable_caching=True)


def test_prefix_hit_reuses_blocks_and_leaves_a_token_to_compute():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    first = _request("a", list(range(10)))
    assert kv.allocate_slots(first, 10)
    table_a = kv.get_block_tables("a")[0]
    second = _request("b", list(range(8)) + [99, 98])  # shares two full blocks
    hits = kv.find_cached_prefix(second)
    assert hits.block_ids == [table_a[:2]]
    exact = _request("c", list(range(8)))  # fully cached: the last block is recomputed
    assert kv.find_cached_prefix(exact).block_ids == [table_a[:1]]
    assert kv.pool.num_hit_blocks == 3


def test_shared_blocks_survive_one_owner_and_all_free_at_the_end():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    a = _request("a", list(range(9)))
    assert kv.allocate_slots(a, 9)
    b = _request("b", list(range(9)))
    hits = kv.find_cached_prefix(b)
    b.num_computed_tokens = hits.num_blocks * 4
    assert kv.allocate_slots(b, 9 - b.num_computed_tokens, hits)
    assert kv.get_block_tables("b")[0][:2] == kv.get_block_tables("a")[0][:2]
    kv.free(a)
    assert kv.num_free_blocks == 9 - 3  # b holds 2 shared blocks and 1 of its own
    kv.free(b)
    assert kv.num_free_blocks == 9


def test_free_blocks_evicted_least_recently_freed_first():
    kv = KVCacheManager(num_blocks=5, block_size=2, enable_prefix_caching=True)
    old = _request("old", [1, 2, 3, 4])
    new = _request("new", [5, 6, 7, 8])
    assert kv.allocate_slots(old, 4) and kv.allocate_slots(new, 4)
    kv.free(old)
    kv.free(new)
    # One more block is needed: it must come from "old" (freed first), tail block first.
    filler = _request("filler", [9, 9])
    assert kv.allocate_slots(filler, 2)
    assert kv.find_cached_prefix(_request("x", [5, 6, 7, 8, 0])).num_blocks == 2
    assert kv.find_cached_prefix(_request("y", [1, 2, 3, 4, 0])) == kv.find_cached_prefix(
        _request("z", [1, 2, 0]))
    assert kv.find_cached_prefix(_request("w", [1, 2, 3, 4, 0])).num_blocks == 1  # block [3, 4] evicted


def test_allocation_fails_cleanly_when_blocks_run_out():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    big = _request("big", list(range(12)))
    assert not kv.allocate_slots(big, 12)
    assert kv.num_free_blocks == 2 and "big" not in kv.groups[0].block_tables
