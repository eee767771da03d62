"""Snapshots of the engine's counters: what the scheduler and the KV cache report to their users.

Metrics, the server and tests read these frozen snapshots instead of reaching into the scheduler's
queues or the block pool.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SpecDecodeStats:
    """Speculative decoding counters: request-steps that verified drafts, and per draft position how many
    drafts were verified there and how many of them were accepted."""

    num_verified_requests: int = 0
    num_drafted_per_position: tuple[int, ...] = ()
    num_accepted_per_position: tuple[int, ...] = ()

    @property
    def num_draft_tokens(self) -> int:
        return sum(self.num_drafted_per_position)

    @property
    def num_accepted_tokens(self) -> int:
        return sum(self.num_accepted_per_position)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_per_position(self) -> tuple[float, ...]:
        return tuple(a / d if d else 0.0 for a, d in zip(self.num_accepted_per_position,
                                                          self.num_drafted_per_position))

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying request appends per step: its accepted drafts plus the model's own token."""
        if not self.num_verified_requests:
            return 0.0
        return 1.0 + self.num_accepted_tokens / self.num_verified_requests


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Sequences in each queue (a request with n samples counts n), preemptions and speculation so far."""

    num_running: int
    num_waiting: int
    num_preemptions: int
    spec_decode: SpecDecodeStats = SpecDecodeStats()


@dataclass(frozen=True, slots=True)
class CacheStats:
    """The KV cache's blocks and prefix-cache counters."""

    num_free_blocks: int
    num_usable_blocks: int  # all blocks but the reserved null block
    block_size: int
    num_prefix_query_tokens: int  # prompt tokens looked up in the prefix cache
    num_prefix_hit_tokens: int  # of which found there

    @property
    def capacity_tokens(self) -> int:
        return self.num_usable_blocks * self.block_size

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine: its queues and its KV cache (see LLMEngine.stats)."""

    num_running: int  # sequences (a request with n samples counts n)
    num_waiting: int
    num_free_blocks: int
    num_usable_blocks: int  # all blocks but the reserved null block
    num_prefix_query_tokens: int  # prompt tokens looked up in the prefix cache
    num_prefix_hit_tokens: int  # of which found there
    num_preemptions: int
    spec_decode: SpecDecodeStats = SpecDecodeStats()

    @classmethod
    def of(cls, scheduler: SchedulerStats, cache: CacheStats) -> EngineStats:
        return cls(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            num_free_blocks=cache.num_free_blocks,
            num_usable_blocks=cache.num_usable_blocks,
            num_prefix_query_tokens=cache.num_prefix_query_tokens,
            num_prefix_hit_tokens=cache.num_prefix_hit_tokens,
            num_preemptions=scheduler.num_preemptions,
            spec_decode=scheduler.spec_decode,
        )

    @property
    def num_unfinished(self) -> int:
        return self.num_running + self.num_waiting

    @property
    def kv_cache_usage(self) -> float:
        """The share of KV cache blocks in use (0 for a pooling engine, which keeps none)."""
        if not self.num_usable_blocks:
            return 0.0
        return 1.0 - self.num_free_blocks / self.num_usable_blocks
