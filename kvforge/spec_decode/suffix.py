"""Suffix decoding: draft the most frequent continuation of the latest tokens, as seen in this request and
in the outputs of earlier requests (SuffixDecoding, Oliaro et al. 2024).

Each trie counts every substring of up to max_depth tokens of the sequences added to it. A node's children
are the tokens that followed its substring, with how often; the draft follows the most frequent child while
the product of the children's shares (the estimated chance that the whole draft is accepted) stays at or
above min_token_prob, for at most match_length * spec_factor tokens (longer matches earn longer drafts).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class SuffixTrie:
    """Substring counts of the sequences added, up to max_depth tokens deep.

    A node is an int indexing flat lists: its count, the total of its children's counts, and its children as a
    dict {token id: node}. The dicts hold only ints, so Python's cyclic collector never tracks them. NOTE: with a
    Python object per node, a sampling profile of single-stream open chat put a quarter of each step under the
    node constructor (the allocation, and the collections it triggers, which walk every tracked node); with int
    nodes suffix went from 0.915x to 1.105x of no speculation there (`kvforge bench speculative --methods
    off,suffix --workloads chat --streams 1`, benchmarks/RESULTS.md)."""

    ROOT = 0

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.counts = [0]
        self.totals = [0]
        self.children: list[dict[int, int]] = [{}]
        self.free: list[int] = []  # nodes dropped by remove(), reused first

    def _child(self, node: int, token_id: int) -> int:
        """node's child for token_id, made (count 0) if missing."""
        child = self.children[node].get(token_id)
        if child is None:
            if self.free:
                child = self.free.pop()
            else:
                child = len(self.counts)
                self.counts.append(0)
                self.totals.append(0)
                self.children.append({})
            self.children[node][token_id] = child
        return child

    def extend(self, active: list[int], token_id: int) -> list[int]:
        """Count token_id after each substring in active (the nodes of the suffixes ending at the previous
        token, longest first); returns the nodes of the suffixes ending at token_id, longest first."""
        extended = []
        counts, totals = self.counts, self.totals
        for node in [*(active[-(self.max_depth - 1):] if len(active) >= self.max_depth else active), self.ROOT]:
            child = self._child(node, token_id)
            counts[child] += 1
            totals[node] += 1
            extended.append(child)
        return extended

    def add(self, token_ids: Sequence[int]) -> None:
        active: list[int] = []
        for token_id in token_ids:
            active = self.extend(active, token_id)

    def remove(self, token_ids: Sequence[int]) -> None:
        """Undo add(token_ids), dropping the nodes that nothing counts any more."""
        for start in range(len(token_ids)):
            node = self.ROOT
            for token_id in token_ids[start : start + self.max_depth]:
                child = self.children[node][token_id]
                self.counts[child] -= 1
                self.totals[node] -= 1
                if self.counts[child] == 0:  # so are all the substrings that extend it
                    del self.children[node][token_id]
                    self._drop(child)
                    break
                node = child

    def _drop(self, node: int) -> None:
        stack = [node]
        while stack:
            node = stack.pop()
            stack.extend(self.children[node].values())
            self.counts[node] = self.totals[node] = 0
            self.children[node] = {}
            self.free.append(node)

    def node(self, token_ids: Sequence[int]) -> int | None:
        """The node of the substring token_ids, None if it was never counted."""
        node: int | None = self.ROOT
        for token_id in token_ids:
            node = self.children[node].get(token_id)
            if node is None:
                return None
        return node

    def count(self, token_ids: Sequence[int]) -> int:
        """How often token_ids occurs in the sequences added (as far as max_depth counts it)."""
        node = self.node(token_ids)
        return 0 if node is None else self.counts[node]

    def nodes_in_use(self) -> int:
        return len(self.counts) - len(self.free) - 1  # the root aside

    def find(self, context: Sequence[int]) -> list[tuple[int, int]]:
        """(length, node) of each suffix of context (up to max_depth - 1 tokens) present here, longest first."""
        found = []
        for length in range(min(len(context), self.max_depth - 1), 0, -1):
            node = self.node(context[len(context) - length :])
            if node is not None:
                found.append((length, node))
        return found

    def continuation(self, node: int, max_num_tokens: int, min_token_prob: float) -> tuple[list[int], float]:
        """The most frequent continuation from node and its score (the expected number of accepted tokens)."""
        draft, prob, score = [], 1.0, 0.0
        counts = self.counts
        while self.children[node] and len(draft) < max_num_tokens:
            token_id, child = max(self.children[node].items(), key=lambda item: counts[item[1]])
            prob *= counts[child] / self.totals[node]
            if prob < min_token_prob:
                break
            draft.append(token_id)
            score += prob
            node = child
        return draft, score


class SuffixProposer:
    """Drafts from a trie of the request's own tokens and one of the last max_cached_requests finished
    requests' tokens (least recently finished dropped first); the higher-scoring draft wins."""

    def __init__(self, max_depth: int = 24, min_token_prob: float = 0.1, spec_factor: float = 1.0,
                 max_cached_requests: int = 64) -> None:
        if max_depth < 2:
            raise ValueError(f"suffix max_depth must be >= 2, got {max_depth}")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"suffix min_token_prob must be in [0, 1], got {min_token_prob}")
        self.max_depth = max_depth
        self.min_token_prob = min_token_prob
        self.spec_factor = spec_factor
        self.max_cached_requests = max_cached_requests
        self.global_trie = SuffixTrie(max_depth)
        self.cached: OrderedDict[str, list[int]] = OrderedDict()
        # per running request: its trie, how many of its tokens it holds, the nodes of its latest suffixes
        self.local: dict[str, tuple[SuffixTrie, int, list[int]]] = {}

    def _local_matches(self, request_id: str, token_ids: Sequence[int]) -> list[tuple[SuffixTrie, int, int]]:
        trie, num_added, active = self.local.get(request_id) or (SuffixTrie(self.max_depth), 0, [])
        for token_id in token_ids[num_added:]:
            active = trie.extend(active, token_id)
        self.local[request_id] = (trie, len(token_ids), active)
        # active[i] is the suffix of len(active) - i tokens; the whole context's own last occurrence has
        # no continuation yet, so only earlier occurrences can have children
        return [(trie, len(active) - i, node) for i, node in enumerate(active) if len(active) - i < self.max_depth]

    def propose(self, requests: Sequence[tuple[str, Sequence[int]]], max_num_tokens: int) -> list[list[int]]:
        """Each request's drafts; its own trie takes its tokens since the previous call first."""
        return [self._propose(request_id, token_ids, max_num_tokens) for request_id, token_ids in requests]

    def _propose(self, request_id: str, token_ids: Sequence[int], max_num_tokens: int) -> list[int]:
        best, best_score = [], 0.0
        matches = self._local_matches(request_id, token_ids)
        matches += [(self.global_trie, length, node) for length, node in self.global_trie.find(token_ids)]
        for trie, length, node in matches:
            limit = min(max_num_tokens, max(1, int(length * self.spec_factor)))
            if limit <= best_score:  # a score is at most its draft's length: this match cannot win
                continue
            draft, score = trie.continuation(node, limit, self.min_token_prob)
            if score > best_score:
                best, best_score = draft, score
        return best

    def finish(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Forget the request's own trie; its tokens join the trie of finished requests."""
        self.local.pop(request_id, None)
        if self.max_cached_requests == 0 or not token_ids:
            return
        self.cached[request_id] = list(token_ids)
        self.global_trie.add(token_ids)
        while len(self.cached) > self.max_cached_requests:
            _, old = self.cached.popitem(last=False)
            self.global_trie.remove(old)

    def reset(self) -> None:
        """Forget the finished requests (running ones keep their own tries)."""
        self.global_trie = SuffixTrie(self.max_depth)
        self.cached.clear()
