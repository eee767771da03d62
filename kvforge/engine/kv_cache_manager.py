"""Block tables per request on top of the block pool, with prefix-cache lookups."""

from __future__ import annotations

from kvforge.engine.block_pool import BlockPool, hash_block
from kvforge.engine.request import Request
from kvforge.engine.stats import CacheStats


class KVCacheManager:
    """Gives each request the blocks its tokens need, reusing cached full blocks of equal prefixes.

    Block i of a request holds tokens [i * block_size, (i + 1) * block_size). Once a block is full
    and computed, it is registered in the prefix cache under a hash chained over its parent block.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.block_tables: dict[str, list[int]] = {}
        self.block_hashes: dict[str, list[int]] = {}
        self.num_registered: dict[str, int] = {}  # leading blocks already offered to the prefix cache

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def capacity_tokens(self) -> int:
        return (self.pool.num_blocks - 1) * self.block_size

    def stats(self) -> CacheStats:
        pool = self.pool
        return CacheStats(num_free_blocks=pool.num_free_blocks, num_usable_blocks=pool.num_blocks - 1,
                          block_size=self.block_size, num_prefix_query_tokens=pool.num_hit_queries,
                          num_prefix_hit_tokens=pool.num_hit_blocks * self.block_size)

    def reset_prefix_cache(self) -> None:
        """Forget the cached blocks no request holds (the running requests' blocks stay theirs)."""
        self.pool.reset_prefix_cache()

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables[request_id]

    def _hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        """Hashes of the request's first num_full_blocks blocks (memoized per request)."""
        hashes = self.block_hashes.setdefault(request.request_id, [])
        tokens, size = request.all_token_ids, self.block_size
        # NOTE: an adapter's KV differs from the base model's for the same tokens: its chain starts from a block that
        # no prompt holds, (-1, its id). (Not (-id,): CPython hashes -1 as -2, so ids 1 and 2 would share it.)
        root = None if request.lora is None else hash_block(None, (-1, request.lora.int_id))
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else root, tokens[i * size : (i + 1) * size]))
        return hashes

    def find_cached_prefix(self, request: Request) -> list[int]:
        """The cached blocks matching the request's leading full blocks.

        At least one token is always left to compute, so the step can produce logits to sample from."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        block_ids = []
        for block_hash in self._hashes(request, max_blocks):
            block_id = self.pool.get_cached_block(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        self.pool.num_hit_queries += request.num_prompt_tokens
        self.pool.num_hit_blocks += len(block_ids)
        return block_ids

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_block_ids: list[int] = ()) -> bool:
        """Make room for num_new_tokens more computed tokens; False (and no change) if blocks run out.

        cached_block_ids: prefix-cache hits for a request that has no blocks yet (its
        num_computed_tokens already counts them)."""
        table = self.block_tables.get(request.request_id, [])
        num_computed = request.num_computed_tokens
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = num_needed - len(table) - len(cached_block_ids)
        num_evictable_hits = sum(1 for b in cached_block_ids if self.pool.ref_cnt[b] == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_evictable_hits:
            return False
        self.pool.touch(cached_block_ids)
        table = table + list(cached_block_ids) + self.pool.allocate(max(num_new_blocks, 0))
        self.block_tables[request.request_id] = table
        # NOTE: only blocks full of the request's tokens, never of draft tokens that may be rejected
        self._register(request, min(num_computed + num_new_tokens, request.num_tokens))
        return True

    def _register(self, request: Request, num_tokens: int) -> None:
        """Offer the blocks full of the request's first num_tokens tokens to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = num_tokens // self.block_size
        first = self.num_registered.get(request.request_id, 0)
        hashes = self._hashes(request, num_full)
        for block_id, block_hash in zip(self.block_tables[request.request_id][first:num_full], hashes[first:]):
            self.pool.cache_block(block_id, block_hash)
        self.num_registered[request.request_id] = max(first, num_full)

    def register_accepted(self, request: Request) -> None:
        """After a verification step: offer the blocks that accepted drafts filled to the prefix cache.

        NOTE: the blocks past the request's tokens (the slots of rejected drafts) stay in its table, which
        the runner extends append-only; the next steps overwrite those slots, and free() releases them."""
        self._register(request, min(request.num_computed_tokens, request.num_tokens))

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first, so its last blocks are evicted before its first."""
        table = self.block_tables.pop(request.request_id, [])
        self.pool.free(reversed(table))
        self.block_hashes.pop(request.request_id, None)
        self.num_registered.pop(request.request_id, None)
