"""Block tables per request and layer group on top of the one block pool, with prefix-cache lookups."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvforge.engine.block_pool import BlockPool, hash_block
from kvforge.engine.cache_groups import CacheGroup, RecurrentStateGroup, make_group
from kvforge.engine.request import Request
from kvforge.engine.stats import CacheStats
from kvforge.layers.kv_cache_spec import LayerGroup

FULL_ATTENTION = (LayerGroup("full_attention", (0,)),)


@dataclass(slots=True)
class PrefixHit:
    """The leading num_blocks blocks of a request found in the prefix cache: block_ids[g] for group g (the null
    block where a group keeps none, outside a sliding window)."""

    num_blocks: int
    block_ids: list[list[int]]


class KVCacheManager:
    """Gives each request the blocks its tokens need in every layer group, reusing cached full blocks of equal
    prefixes, and returns to the pool the blocks a group's layers will not read again (sliding windows).

    Block i of a request's table in a group holds tokens [i * block_size, (i + 1) * block_size) for the group's
    layers. Once a block is full and computed, it is registered in the prefix cache under a hash chained over its
    parent block (and its group). Every group's table of a request is equally long.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 layer_groups: Sequence[LayerGroup] = FULL_ATTENTION, max_step_tokens: int = 1,
                 num_state_checkpoints: int = 0) -> None:
        """max_step_tokens: the most tokens of one request a step computes (the scheduler's token budget), which a
        sliding window holds beside its window; it bounds capacity_tokens. num_state_checkpoints: with prefix caching,
        the linear-attention states a recurrent-state group keeps for prefix hits (engine/state_checkpoints.py)."""
        self.block_size = block_size
        self.max_step_tokens = max_step_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        num_state_checkpoints = num_state_checkpoints if enable_prefix_caching else 0
        self.groups: list[CacheGroup] = [make_group(g, layers, self.pool, block_size, num_state_checkpoints)
                                        for g, layers in enumerate(layer_groups)]
        # the recurrent-state group that keeps checkpoints (a hybrid model's, with prefix caching), if any
        self.states = next((g for g in self.groups if isinstance(g, RecurrentStateGroup) and g.checkpoints), None)
        self.block_hashes: dict[str, list[int]] = {}
        self.num_registered: dict[str, int] = {}  # leading blocks already offered to the prefix cache
        # request -> the end (in tokens) of the prefix it shares with cached KV blocks where no checkpoint covers it
        self.shared_prefix_ends: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def capacity_tokens(self) -> int:
        """The longest request the pool holds alone, in whole blocks (a sliding window holds its window and a step)."""
        usable = self.pool.num_blocks - 1
        low, high = 0, usable  # in blocks of tokens: low fits, high + 1 does not
        while low < high:
            mid = (low + high + 1) // 2
            held = sum(group.max_blocks_held(mid * self.block_size, self.max_step_tokens) for group in self.groups)
            if held <= usable:
                low = mid
            else:
                high = mid - 1
        return low * self.block_size

    def stats(self) -> CacheStats:
        pool = self.pool
        return CacheStats(num_free_blocks=pool.num_free_blocks, num_usable_blocks=pool.num_blocks - 1,
                          block_size=self.block_size, num_prefix_query_tokens=pool.num_hit_queries,
                          num_prefix_hit_tokens=pool.num_hit_blocks * self.block_size)

    def reset_prefix_cache(self) -> None:
        """Forget the cached blocks no request holds (the running requests' blocks stay theirs), and the kept
        linear-attention states."""
        self.pool.reset_prefix_cache()
        if self.states is not None:
            self.states.checkpoints.reset()

    def get_block_tables(self, request_id: str) -> list[list[int]]:
        """The request's table in every group."""
        return [group.table(request_id) for group in self.groups]

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

    def find_cached_prefix(self, request: Request) -> PrefixHit:
        """The longest run of the request's leading full blocks that every group can serve from the cache.

        At least one token is always left to compute, so the step can produce logits to sample from."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return PrefixHit(0, [[] for _ in self.groups])
        hashes = self._hashes(request, (request.num_tokens - 1) // self.block_size)
        num_blocks = _longest_hit(self.groups, hashes)
        if self.states is not None:  # where the KV blocks serve more than the kept states: keep the state there
            num_shared = _longest_hit([g for g in self.groups if g is not self.states], hashes)
            if num_shared > num_blocks:
                self.shared_prefix_ends[request.request_id] = num_shared * self.block_size
        self.pool.num_hit_queries += request.num_prompt_tokens
        self.pool.num_hit_blocks += num_blocks
        return PrefixHit(num_blocks, [group.hit_block_ids(hashes, num_blocks) for group in self.groups])

    def allocate_slots(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Make room for num_new_tokens more computed tokens in every group; False (and no new blocks) if blocks run
        out. The blocks the request has moved past in sliding windows are released first, either way.

        hit: the prefix-cache hit of a request that has no blocks yet (its num_computed_tokens already counts it)."""
        request_id, num_computed = request.request_id, request.num_computed_tokens
        hit_ids = hit.block_ids if hit is not None else [[] for _ in self.groups]
        for group in self.groups:
            group.release_passed(request_id, num_computed)
        num_tokens = num_computed + num_new_tokens
        num_needed = sum(group.blocks_needed(request_id, num_tokens, ids) for group, ids in zip(self.groups, hit_ids))
        if num_needed > self.pool.num_free_blocks:
            return False
        for group, ids in zip(self.groups, hit_ids):
            group.take_hit(request_id, ids)
        for group in self.groups:
            group.allocate(request_id, num_tokens)
        # NOTE: only blocks full of the request's tokens, never of draft tokens that may be rejected
        self._register(request, min(num_tokens, request.num_tokens))
        return True

    def _register(self, request: Request, num_tokens: int) -> None:
        """Offer the blocks full of the request's first num_tokens tokens to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = num_tokens // self.block_size
        first = self.num_registered.get(request.request_id, 0)
        hashes = self._hashes(request, num_full)
        for group in self.groups:
            group.register(request.request_id, hashes, first, num_full)
        self.num_registered[request.request_id] = max(first, num_full)

    def register_accepted(self, request: Request) -> None:
        """After a verification step: offer the blocks that accepted drafts filled to the prefix cache.

        NOTE: the blocks past the request's tokens (the slots of rejected drafts) stay in its table, which
        the runner extends append-only; the next steps overwrite those slots, and free() releases them."""
        self._register(request, min(request.num_computed_tokens, request.num_tokens))

    def cut_chunk(self, request: Request, num_new: int) -> int:
        """With state checkpoints: a chunk of num_new tokens from the request's num_computed_tokens that crosses the
        last block boundary before its last token, or the end of the prefix it shares with cached blocks, stops
        there (the first of them), so the state there is kept (engine/state_checkpoints.py). Else num_new."""
        if self.states is None:
            return num_new
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
        last_boundary = min(end, request.num_tokens - 1) // self.block_size * self.block_size
        cuts = [cut for cut in (last_boundary, self.shared_prefix_ends.get(request.request_id, 0)) if start < cut < end]
        return min(cuts) - start if cuts else num_new

    def state_copies(self, request: Request, num_new: int, num_drafts: int) -> tuple[int | None, int | None]:
        """A scheduled step of num_new tokens (and num_drafts drafts) of the request: (the checkpoint its state slot
        takes before the step: its prefix hit's, the checkpoint its slot is copied into after the step: where the
        step ends on a block boundary short of its last token, with no drafts), each None where there is none."""
        if self.states is None:
            return None, None
        load = self.states.loads.pop(request.request_id, None)
        end = request.num_computed_tokens + num_new
        if num_drafts or end % self.block_size or not request.num_computed_tokens < end < request.num_tokens:
            return load, None
        num_blocks = end // self.block_size
        return load, self.states.checkpoints.reserve(self._hashes(request, num_blocks)[num_blocks - 1])

    def states_saved(self, checkpoints: list[int]) -> None:
        """The step that saves these checkpoints has run: prefix lookups find them from now."""
        for checkpoint in checkpoints:
            self.states.checkpoints.saved(checkpoint)

    def free(self, request: Request) -> None:
        """Release a request's blocks in every group."""
        for group in self.groups:
            group.free(request.request_id)
        self.block_hashes.pop(request.request_id, None)
        self.num_registered.pop(request.request_id, None)
        self.shared_prefix_ends.pop(request.request_id, None)


def _longest_hit(groups: Sequence[CacheGroup], hashes: list[int]) -> int:
    """The longest run of leading blocks (of hashes) that every one of groups serves from the cache."""
    num_blocks, previous = len(hashes), -1
    while num_blocks != previous:  # NOTE: a group's shorter answer may be one another group cannot serve
        previous = num_blocks
        for group in groups:
            num_blocks = group.longest_hit(hashes, num_blocks)
    return num_blocks
