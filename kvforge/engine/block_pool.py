"""The pool of KV cache blocks: reference counts, the free queue (LRU) and the prefix-cache index."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

NULL_BLOCK_ID = 0


def hash_block(parent_hash: int | None, token_ids: Iterable[int]) -> int:
    """Identity of a full block: chained over its parent's hash, so equal hashes mean equal prefixes.

    NOTE: Python's tuple hash of ints is deterministic across processes (no hash randomization for
    ints), and 64-bit collisions are negligible at cache sizes of millions of blocks."""
    return hash((parent_hash, tuple(token_ids)))


class BlockPool:
    """Fixed-size blocks 1..num_blocks-1 (block 0 is the reserved null block, used for padding).

    A block is either in use (ref_cnt > 0) or in the free queue. Free blocks may still hold a cached
    prefix block; they are reused least-recently-freed first, and their cache entry is dropped then.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.cached_blocks: dict[int, int] = {}
        self.num_hit_queries = 0
        self.num_hit_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: int) -> int | None:
        return self.cached_blocks.get(block_hash)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take num_blocks blocks from the front of the free queue, evicting their cached content."""
        assert num_blocks <= len(self.free_queue)
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self.free_queue.popitem(last=False)
            self._evict(block_id)
            self.ref_cnt[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks that a new request reuses."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_cnt[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop a reference; blocks that reach zero go to the back of the free queue in the given order."""
        for block_id in block_ids:
            assert self.ref_cnt[block_id] > 0, f"double free of block {block_id}"
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self.free_queue[block_id] = None

    def cache_block(self, block_id: int, block_hash: int) -> None:
        """Register a full block under its hash; the latest block with a given hash wins.

        NOTE: an older block of the same hash may still be cached but free (a request whose hit another layer group
        could not serve computed the block again): indexed, it would take the hash with it when it is evicted, while
        the newer copy stays in use."""
        if self.enable_caching and self.block_hash[block_id] is None:
            self.cached_blocks[block_hash] = block_id
            self.block_hash[block_id] = block_hash

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            if self.cached_blocks.get(block_hash) == block_id:
                del self.cached_blocks[block_hash]
            self.block_hash[block_id] = None

    def reset_prefix_cache(self) -> None:
        for block_id in list(self.free_queue):
            self._evict(block_id)
