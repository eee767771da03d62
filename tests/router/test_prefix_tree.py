"""The router's radix tree against brute force (os.path.commonprefix over everything each replica was sent)."""

from __future__ import annotations

import os
import random

import pytest

from kvforge.router.prefix_tree import PrefixTree


def _brute_force(sent: dict[str, list[str]], text: str) -> dict[str, int]:
    matched = {r: max(len(os.path.commonprefix([t, text])) for t in texts) for r, texts in sent.items()}
    return {r: n for r, n in matched.items() if n}


def test_random_texts_match_brute_force() -> None:
    rng = random.Random(0)
    stems = ["".join(rng.choice("abc ") for _ in range(rng.randint(0, 40))) for _ in range(8)]
    tree, sent = PrefixTree(), {}
    for _ in range(300):
        text = rng.choice(stems) + "".join(rng.choice("abcd") for _ in range(rng.randint(0, 12)))
        replica = rng.choice(["A", "B", "C"])
        query = rng.choice(stems) + "".join(rng.choice("abcd") for _ in range(rng.randint(0, 12)))
        assert tree.match(query) == _brute_force(sent, query)
        tree.insert(text, replica)
        sent.setdefault(replica, []).append(text)
    for replica, texts in sent.items():  # the characters a replica holds: its distinct texts' trie size
        prefixes = {t[:k] for t in texts for k in range(1, len(t) + 1)}
        assert tree.num_chars(replica) == len(prefixes)


def test_shared_system_prompt_and_divergence() -> None:
    tree = PrefixTree()
    tree.insert("You are a helpful assistant. Q: 1+1", "A")
    tree.insert("You are a helpful bot. Q: hi", "B")
    assert tree.match("You are a helpful assistant. Q: 2") == {"A": 32, "B": 18}
    assert tree.match("Tell me") == {}
    tree.remove_replica("A")
    assert tree.match("You are a helpful assistant. Q: 2") == {"B": 18}
    assert tree.num_chars("A") == 0


def test_the_least_recently_used_texts_are_evicted_past_the_bound() -> None:
    tree = PrefixTree(max_chars_per_replica=100)
    tree.insert("x" * 40, "A")
    tree.insert("y" * 40, "A")
    tree.insert("x" * 40, "A")  # x is used again: y is now the older one
    tree.insert("z" * 40, "A")
    assert tree.num_chars("A") <= 90
    assert tree.match("x" * 40) == {"A": 40} and tree.match("z" * 40) == {"A": 40}
    assert tree.match("y" * 40) == {}


def test_bad_bound_is_named() -> None:
    with pytest.raises(ValueError, match="max_chars_per_replica must be >= 1, got 0"):
        PrefixTree(max_chars_per_replica=0)
