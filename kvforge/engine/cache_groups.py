"""The groups of layers of the KV cache manager: each keeps its own block table per request in the one shared pool.

A group is a set of layers that keep the same thing per token; they share one block table per request (block i of
the table holds tokens [i * block_size, (i + 1) * block_size) for every layer of the group). The manager asks every
group the same questions, so a new kind of layer is one more class here:

    max_blocks_held(num_tokens, step_tokens)     the most blocks a request of num_tokens tokens holds at once, when
                                                 a step computes up to step_tokens of its tokens
    blocks_needed(request_id, num_tokens, hit)   how many pool blocks the group must take to hold num_tokens tokens
    take_hit(request_id, hit)                    take a new request's prefix-cache blocks (every group's, before any
                                                 group allocates: a fresh block may evict a cached one)
    allocate(request_id, num_tokens)             take the new blocks (after the manager checked every group fits)
    release_passed(request_id, num_computed)     give back what the request will never read again
    longest_hit(hashes, num_blocks)              the longest prefix (in blocks, <= num_blocks) it can serve
    hit_block_ids(hashes, num_blocks)            the blocks of such a hit (the null block where it keeps none)
    register(request_id, hashes, num_full)       offer full, computed blocks to the prefix cache
    free(request_id)                             release everything the request holds

Full attention keeps every block. A sliding window of W tokens: the query at position p reads keys p - W + 1 .. p,
so once a request has computed c tokens, its next query (p = c) never reads a key below c - W + 1, and the blocks
that end at or before it go back to the pool (the table keeps the null block in their place):

    window W = 6, block_size 4, c = 11:   keys read from 11 - 6 + 1 = 6
    | b0: 0..3 | b1: 4..7 | b2: 8..11 |    b0 ends at 4 <= 6: freed; b1 holds key 6: kept
"""

from __future__ import annotations

import heapq

from kvforge.engine.block_pool import NULL_BLOCK_ID, BlockPool
from kvforge.engine.state_checkpoints import StateCheckpoints
from kvforge.layers.kv_cache_spec import LayerGroup


class FullAttentionGroup:
    """Layers that attend to every earlier token: a block per block_size tokens, all kept until the request ends."""

    def __init__(self, group_id: int, pool: BlockPool, block_size: int) -> None:
        self.group_id = group_id
        self.pool = pool
        self.block_size = block_size
        self.block_tables: dict[str, list[int]] = {}

    def table(self, request_id: str) -> list[int]:
        return self.block_tables[request_id]

    def _key(self, block_hash: int) -> int:
        """The prefix-cache key of a block of this group (groups keep different blocks for the same tokens)."""
        return hash((self.group_id, block_hash))

    def blocks_needed(self, request_id: str, num_tokens: int, hit: list[int]) -> int:
        """Pool blocks to take so the request holds num_tokens tokens; hit: a new request's prefix-cache blocks,
        which count as taken from the pool where no request holds them (they leave the free queue)."""
        num_held = len(self.block_tables.get(request_id, ())) + len(hit)
        num_evictable_hits = sum(1 for b in hit if b != NULL_BLOCK_ID and self.pool.ref_cnt[b] == 0)
        return max(0, -(-num_tokens // self.block_size) - num_held) + num_evictable_hits

    def take_hit(self, request_id: str, hit: list[int]) -> None:
        self.pool.touch(b for b in hit if b != NULL_BLOCK_ID)
        self.block_tables.setdefault(request_id, []).extend(hit)

    def allocate(self, request_id: str, num_tokens: int) -> None:
        table = self.block_tables.setdefault(request_id, [])
        table.extend(self.pool.allocate(max(0, -(-num_tokens // self.block_size) - len(table))))

    def max_blocks_held(self, num_tokens: int, step_tokens: int = 1) -> int:
        """The most blocks a request of num_tokens tokens holds at once (step_tokens: the most a step computes)."""
        return -(-num_tokens // self.block_size)

    def release_passed(self, request_id: str, num_computed: int) -> None:
        """Full attention reads every earlier key: nothing is released before the request ends."""

    def longest_hit(self, hashes: list[int], num_blocks: int) -> int:
        for i in range(num_blocks):
            if self.pool.get_cached_block(self._key(hashes[i])) is None:
                return i
        return num_blocks

    def hit_block_ids(self, hashes: list[int], num_blocks: int) -> list[int]:
        return [self.pool.get_cached_block(self._key(h)) for h in hashes[:num_blocks]]

    def register(self, request_id: str, hashes: list[int], first: int, num_full: int) -> None:
        """Offer blocks first..num_full-1 (full of computed tokens) to the prefix cache, the ones still held."""
        table = self.block_tables[request_id]
        for i in range(first, num_full):
            if table[i] != NULL_BLOCK_ID:
                self.pool.cache_block(table[i], self._key(hashes[i]))

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first, so its last blocks are evicted before its first."""
        table = self.block_tables.pop(request_id, [])
        self.pool.free(b for b in reversed(table) if b != NULL_BLOCK_ID)


class SlidingWindowGroup(FullAttentionGroup):
    """Layers whose query at position p reads the keys of positions p - window + 1 .. p only: a request keeps the
    blocks of its window (and of the step's new tokens); the blocks it has moved past go back to the pool."""

    def __init__(self, group_id: int, pool: BlockPool, block_size: int, window: int) -> None:
        super().__init__(group_id, pool, block_size)
        self.window = window

    def _first_kept_block(self, num_computed: int) -> int:
        """The first block the next query (at position num_computed) reads."""
        return max(0, num_computed - self.window + 1) // self.block_size

    def max_blocks_held(self, num_tokens: int, step_tokens: int = 1) -> int:
        """The window before a step's first token and the step's tokens: ceil((W - 1 + step) / block_size) + 1."""
        return min(-(-num_tokens // self.block_size), -(-(self.window - 1 + step_tokens - 1) // self.block_size) + 1)

    def release_passed(self, request_id: str, num_computed: int) -> None:
        table = self.block_tables.get(request_id)
        if table is None:
            return
        for i in range(min(self._first_kept_block(num_computed), len(table))):
            if table[i] != NULL_BLOCK_ID:
                self.pool.free([table[i]])
                table[i] = NULL_BLOCK_ID

    def longest_hit(self, hashes: list[int], num_blocks: int) -> int:
        """The longest prefix of at most num_blocks blocks whose window blocks (the ones the first query after it
        reads) are all cached; earlier blocks need not be (NOTE: unlike full attention, a shorter prefix is not
        implied by a longer one, so every length is tried from the longest down)."""
        for length in range(num_blocks, 0, -1):
            window = range(self._first_kept_block(length * self.block_size), length)
            if all(self.pool.get_cached_block(self._key(hashes[i])) is not None for i in window):
                return length
        return 0

    def hit_block_ids(self, hashes: list[int], num_blocks: int) -> list[int]:
        first = self._first_kept_block(num_blocks * self.block_size)
        return [NULL_BLOCK_ID] * first + super().hit_block_ids(hashes[first:num_blocks], num_blocks - first)


class RecurrentStateGroup:
    """Linear-attention layers (Gated DeltaNet): a fixed-size state per request, in one slot per running request and
    no blocks. A request takes a slot when it is first scheduled (again after a preemption, to recompute) and gives it
    back when it finishes, is aborted or is preempted. Its "table" in this group is [its slot id], sent to the runner
    once with the request (later steps add no blocks to it).

    The slot is the smallest free one, so slot ids stay below the number of requests running at once (max_num_seqs,
    the slots the runner allocates). A prefix-cache hit needs the state after the hit's last block, which no slot
    keeps: it comes from the group's checkpoints (engine/state_checkpoints.py), a hit of k blocks only where block
    k - 1 has one; without checkpoints (num_checkpoints 0) there are no hits and every prompt is recomputed."""

    def __init__(self, num_checkpoints: int = 0) -> None:
        self.slots: dict[str, int] = {}
        self.free_slots: list[int] = []  # a heap of the slots given back below next_slot
        self.next_slot = 0
        self.checkpoints = StateCheckpoints(num_checkpoints) if num_checkpoints else None
        self.loads: dict[str, int] = {}  # request -> the checkpoint its slot takes before its first step

    @property
    def num_used_slots(self) -> int:
        return len(self.slots)

    def table(self, request_id: str) -> list[int]:
        return [self.slots[request_id]]

    def blocks_needed(self, request_id: str, num_tokens: int, hit: list[int]) -> int:
        return 0

    def take_hit(self, request_id: str, hit: list[int]) -> None:
        """hit: [the checkpoint of the hit's last block] (none without a hit)."""
        if hit:
            self.loads[request_id] = hit[0]

    def allocate(self, request_id: str, num_tokens: int) -> None:
        if request_id in self.slots:
            return
        if self.free_slots:
            self.slots[request_id] = heapq.heappop(self.free_slots)
        else:
            self.slots[request_id] = self.next_slot
            self.next_slot += 1

    def max_blocks_held(self, num_tokens: int, step_tokens: int = 1) -> int:
        return 0

    def release_passed(self, request_id: str, num_computed: int) -> None:
        """The state is the request's until it ends."""

    def longest_hit(self, hashes: list[int], num_blocks: int) -> int:
        """The longest prefix of at most num_blocks blocks whose last block has a checkpoint."""
        if self.checkpoints is None:
            return 0
        return next((n for n in range(num_blocks, 0, -1) if self.checkpoints.find(hashes[n - 1]) is not None), 0)

    def hit_block_ids(self, hashes: list[int], num_blocks: int) -> list[int]:
        """[the checkpoint of block num_blocks - 1] (most recently used from now); [] for no hit."""
        return [self.checkpoints.use(hashes[num_blocks - 1])] if num_blocks else []

    def register(self, request_id: str, hashes: list[int], first: int, num_full: int) -> None:
        """Checkpoints are saved by the steps that end on a block boundary (KVCacheManager.state_copies), not here."""

    def free(self, request_id: str) -> None:
        self.loads.pop(request_id, None)
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            heapq.heappush(self.free_slots, slot)


CacheGroup = FullAttentionGroup | RecurrentStateGroup


def make_group(group_id: int, layers: LayerGroup, pool: BlockPool, block_size: int, num_state_checkpoints: int = 0
               ) -> CacheGroup:
    """The manager's group for one LayerGroup of the model's KV cache spec (num_state_checkpoints: a recurrent-state
    group's checkpoints for the prefix cache)."""
    if layers.kind == "recurrent_state":
        return RecurrentStateGroup(num_state_checkpoints)
    if layers.kind == "sliding_window":
        return SlidingWindowGroup(group_id, pool, block_size, layers.sliding_window)
    assert layers.kind == "full_attention", f"no cache group for layers of kind {layers.kind!r}"
    return FullAttentionGroup(group_id, pool, block_size)
