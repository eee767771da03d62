"""Which replica a request goes to: where its prompt's longest prefix was sent (unless that replica is loaded
past the bound), else the least loaded; or plainly round robin."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from kvforge.router.prefix_tree import PrefixTree
from kvforge.router.replica import Replica

POLICIES = ("prefix", "round-robin")


@dataclass(frozen=True, slots=True)
class LoadBound:
    """When a replica is too loaded to take a request for its cache: more than `max_queue_depth` requests it
    has not started, or more than `max_kv_cache_usage` of its KV cache in use, or `max_imbalance` more
    requests in flight than the least busy healthy replica; and the least prefix worth following: at least
    `min_match_chars` characters and `min_match_share` of the prompt (a common opening such as "You are a" is
    no reason to pile every request on one replica)."""

    max_queue_depth: int = 8
    max_kv_cache_usage: float = 0.95
    max_imbalance: int = 32
    min_match_chars: int = 16
    min_match_share: float = 0.2

    def __post_init__(self) -> None:
        for name in ("max_queue_depth", "max_imbalance", "min_match_chars"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.max_kv_cache_usage <= 1:
            raise ValueError(f"max_kv_cache_usage must be in (0, 1], got {self.max_kv_cache_usage}")
        if not 0 <= self.min_match_share <= 1:
            raise ValueError(f"min_match_share must be in [0, 1], got {self.min_match_share}")


@dataclass(frozen=True, slots=True)
class Choice:
    replica: Replica
    prefix_hit: bool  # chosen for the prefix it holds


class Policy:
    """Picks a replica for a prompt among the healthy ones (`exclude`: those a request already failed on)."""

    def __init__(self, name: str, bound: LoadBound | None = None, tree: PrefixTree | None = None) -> None:
        if name not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
        self.name = name
        self.bound = bound or LoadBound()
        self.tree = tree or PrefixTree()
        self._turns = itertools.count()

    def choose(self, replicas: Sequence[Replica], text: str) -> Choice:
        """The replica for `text` among `replicas` (all healthy, at least one); the tree learns the choice."""
        assert replicas, "no replica to choose from"
        if self.name == "round-robin":
            return Choice(replicas[next(self._turns) % len(replicas)], prefix_hit=False)
        by_url = {r.url: r for r in replicas}
        matched = {url: n for url, n in self.tree.match(text).items() if url in by_url}
        best_url = max(matched, key=lambda url: (matched[url], -by_url[url].queue_depth), default=None)
        least_match = max(min(self.bound.min_match_chars, len(text)), self.bound.min_match_share * len(text))
        if (best_url is not None and matched[best_url] >= least_match
                and not self._overloaded(by_url[best_url], replicas)):
            choice = Choice(by_url[best_url], prefix_hit=True)
        else:
            choice = Choice(self._least_loaded(replicas), prefix_hit=False)
        self.tree.insert(text, choice.replica.url)
        return choice

    def forget(self, replica: Replica) -> None:
        """The replica lost its cache (it restarted): nothing it was sent counts any more."""
        self.tree.remove_replica(replica.url)

    def _least_loaded(self, replicas: Sequence[Replica]) -> Replica:
        """The replica with the fewest requests not started, then in flight, then the least KV cache in use, then
        the fewest sent so far (idle replicas take turns), among those within the bound if any are."""
        within = [r for r in replicas if not self._overloaded(r, replicas)] or replicas
        return min(within, key=lambda r: (r.queue_depth, r.num_in_flight, r.load.kv_cache_usage, r.num_requests))

    def _overloaded(self, replica: Replica, replicas: Sequence[Replica]) -> bool:
        bound = self.bound
        least_busy = min(r.num_in_flight for r in replicas)
        return (replica.queue_depth > bound.max_queue_depth or replica.load.kv_cache_usage > bound.max_kv_cache_usage
                or replica.num_in_flight - least_busy > bound.max_imbalance)
