"""An approximate radix tree of the prompt texts sent to each replica: where a new prompt's longest prefix lives.

The router cannot see a replica's KV cache, so it remembers what it sent. One tree holds the texts of all
replicas; each node is tagged with the replicas whose texts pass through it and when they last did.

```
 root ─ "You are a helpful" ─┬─ " assistant. Q: 1+1" {A}
        {A, B}               └─ " bot. Q: hi"        {B}
```

match("You are a helpful assistant. Q: 2") -> {A: 29, B: 17} characters. The tree is approximate: a
replica's cache may have evicted what the tree still holds, and each replica's share is bounded
(`max_chars_per_replica`, the least recently used leaves go first).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class _Node:
    edge: str  # the characters from the parent to this node
    parent: _Node | None
    children: dict[str, _Node] = field(default_factory=dict)  # first character of the child's edge -> child
    last_used: dict[str, int] = field(default_factory=dict)  # replica -> tick of its last insert through here


class PrefixTree:
    """Prompt texts per replica, in one radix tree; `match` gives each replica's longest shared prefix."""

    def __init__(self, max_chars_per_replica: int = 4_000_000) -> None:
        if max_chars_per_replica < 1:
            raise ValueError(f"max_chars_per_replica must be >= 1, got {max_chars_per_replica}")
        self.max_chars_per_replica = max_chars_per_replica
        self._root = _Node("", None)
        self._chars: dict[str, int] = {}  # replica -> characters of the tree tagged with it
        self._ticks = itertools.count(1)

    def num_chars(self, replica: str) -> int:
        return self._chars.get(replica, 0)

    def insert(self, text: str, replica: str) -> None:
        """Remember that `text` was sent to `replica` (then evict its oldest leaves past the bound)."""
        tick = next(self._ticks)
        node, pos = self._root, 0
        node.last_used[replica] = tick
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                child = _Node(text[pos:], node)
                node.children[text[pos]] = child
            else:
                common = _common_length(child.edge, text, pos)
                if common < len(child.edge):
                    child = self._split(child, common)
            if replica not in child.last_used:
                self._chars[replica] = self._chars.get(replica, 0) + len(child.edge)
            child.last_used[replica] = tick
            node, pos = child, pos + len(child.edge)
        if self._chars.get(replica, 0) > self.max_chars_per_replica:
            self._evict(replica)

    def match(self, text: str) -> dict[str, int]:
        """Replica -> characters of `text`'s longest prefix sent to it (replicas with none are left out)."""
        matched: dict[str, int] = {}
        node, pos = self._root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                break
            common = _common_length(child.edge, text, pos)
            for replica in child.last_used:
                matched[replica] = pos + common
            if common < len(child.edge):
                break
            node, pos = child, pos + common
        return matched

    def remove_replica(self, replica: str) -> None:
        """Forget everything sent to `replica` (its cache is gone: it died, or restarted)."""
        stack = [self._root]
        while stack:
            node = stack.pop()
            node.last_used.pop(replica, None)
            stack.extend(node.children.values())
        self._prune(self._root)
        self._chars.pop(replica, None)

    def _split(self, child: _Node, length: int) -> _Node:
        """Cut `child`'s edge after `length` characters; the new middle node is returned."""
        parent = child.parent
        assert parent is not None
        middle = _Node(child.edge[:length], parent, last_used=dict(child.last_used))
        parent.children[middle.edge[0]] = middle
        child.edge = child.edge[length:]
        child.parent = middle
        middle.children[child.edge[0]] = child
        return middle

    def _evict(self, replica: str) -> None:
        """Untag `replica`'s least recently used leaves until it holds at most 90% of its bound."""
        target = self.max_chars_per_replica * 9 // 10
        while self._chars[replica] > target:
            leaves = [node for node in self._tagged(replica)
                      if not any(replica in c.last_used for c in node.children.values())]
            leaves.sort(key=lambda node: node.last_used[replica])
            for leaf in leaves:
                if self._chars[replica] <= target:
                    break
                del leaf.last_used[replica]
                self._chars[replica] -= len(leaf.edge)
        self._prune(self._root)

    def _tagged(self, replica: str) -> list[_Node]:
        found, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            if replica in node.last_used:
                found.append(node)
                stack.extend(node.children.values())
        return found

    def _prune(self, root: _Node) -> None:
        """Drop the nodes no replica is tagged on (a child has a replica only where its parent does)."""
        stack = [root]
        while stack:
            node = stack.pop()
            for key, child in list(node.children.items()):
                if child.last_used:
                    stack.append(child)
                else:
                    del node.children[key]


def _common_length(edge: str, text: str, pos: int) -> int:
    """How many leading characters of `edge` equal text[pos:]."""
    limit = min(len(edge), len(text) - pos)
    n = 0
    while n < limit and edge[n] == text[pos + n]:
        n += 1
    return n
