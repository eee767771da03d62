"""The linear-attention states a hybrid model keeps for the prefix cache: checkpoints at block boundaries.

A request's recurrent state (conv and delta state: RecurrentStateGroup in engine/cache_groups.py) lives in one slot that
each of its steps overwrites, so a prefix-cache hit cannot be served from it. Where a step of a request ends on a block
boundary short of its last token (its first k blocks computed), the runner copies the slot after the step into a
checkpoint: the state after those k blocks, keyed by the hash of block k - 1 (which chains over every block before it,
and a LoRA adapter's root). A later request whose first k blocks every paged group serves from the cache, and whose
block k - 1 has a checkpoint, starts after them: its slot takes a copy of the checkpoint before its first step.

    request A   prompt of 40 tokens, block size 16    chunks [0, 32) and [32, 40) (cut at the last boundary before
                                                      its last token); after the first, its slot -> checkpoint c,
                                                      under the hash of block 1
    request B   A's first 32 tokens, then others      a hit of 2 blocks: checkpoint c -> B's slot; B computes from 32

The scheduler cuts a request's chunk (KVCacheManager.cut_chunk) at the last block boundary before the request's last
token, and at the end of the prefix it shares with cached KV blocks where no checkpoint covers it yet: the first request
that shares a system prompt with an earlier one keeps the state there, for the ones after it. A checkpoint is offered to
lookups once the step that saves it has run (saved()). The pool is bounded (num_checkpoints, the runner's checkpoint
tensors); the least recently used checkpoint is reused first.

NOTE: a load runs before its step and a save after it, on every rank, in step order: a checkpoint reused for a save in
the step that loads it (or in a later one) is read before it is overwritten.
"""

from __future__ import annotations

from collections import OrderedDict


class StateCheckpoints:
    """num_checkpoints checkpoint ids, each holding the state after the block of one hash, or being saved, or free."""

    def __init__(self, num_checkpoints: int) -> None:
        self.num_checkpoints = num_checkpoints
        self.ready: OrderedDict[int, int] = OrderedDict()  # block hash -> checkpoint, least recently used first
        self.saving: dict[int, int] = {}  # checkpoint -> block hash, saved by a step that has not run yet
        self.free: list[int] = list(reversed(range(num_checkpoints)))  # popped from the end: 0 first

    @property
    def num_ready(self) -> int:
        return len(self.ready)

    def find(self, block_hash: int) -> int | None:
        """The checkpoint of the state after the block of block_hash, if one is kept."""
        return self.ready.get(block_hash)

    def use(self, block_hash: int) -> int:
        """A prefix hit takes the checkpoint of block_hash (most recently used from now)."""
        self.ready.move_to_end(block_hash)
        return self.ready[block_hash]

    def reserve(self, block_hash: int) -> int | None:
        """A checkpoint for a step to save the state after the block of block_hash into: a free one, else the least
        recently used; None where that state is kept (or being saved) already, or every checkpoint is being saved."""
        if block_hash in self.ready or block_hash in self.saving.values():
            return None
        if self.free:
            checkpoint = self.free.pop()
        elif self.ready:
            _, checkpoint = self.ready.popitem(last=False)
        else:
            return None
        self.saving[checkpoint] = block_hash
        return checkpoint

    def saved(self, checkpoint: int) -> None:
        """The step that saves into checkpoint has run: lookups find it from now."""
        block_hash = self.saving.pop(checkpoint, None)
        if block_hash is not None:
            self.ready[block_hash] = checkpoint

    def reset(self) -> None:
        """Forget every kept state (the saves in flight stay theirs)."""
        self.free.extend(reversed(self.ready.values()))
        self.ready.clear()
