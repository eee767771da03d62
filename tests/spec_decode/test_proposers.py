"""The n-gram and suffix proposers on hand-made token sequences."""

from __future__ import annotations

import pytest

from kvforge.spec_decode.ngram import NgramProposer
from kvforge.spec_decode.suffix import SuffixProposer, SuffixTrie


def test_ngram_proposes_what_followed_the_most_recent_match():
    proposer = NgramProposer(min_n=1, max_n=3)
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7]
    # the last 3 tokens (3, 6, 7) never appeared before; (6, 7) did, last followed by 2
    assert proposer.propose([("a", tokens)], 3)[0] == [2, 3, 6]
    assert proposer.propose([("a", tokens)], 1)[0] == [2]
    assert proposer.propose([("a", [1, 2, 3, 4])], 3)[0] == []  # no earlier occurrence
    assert NgramProposer(min_n=3, max_n=4).propose([("a", tokens)], 3)[0] == []  # (3, 6, 7) is too new


def test_ngram_prefers_the_longest_match():
    tokens = [1, 2, 9, 4, 2, 8, 1, 2]
    assert NgramProposer(min_n=1, max_n=2).propose([("a", tokens)], 2)[0] == [9, 4]  # (1, 2) -> 9, not (2) -> 8
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(min_n=3, max_n=2)


def test_suffix_drafts_the_most_frequent_continuation_of_its_own_tokens():
    proposer = SuffixProposer(max_depth=8, min_token_prob=0.3, spec_factor=2.0)
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 4, 9, 1, 2, 3, 5, 0, 1, 2]
    # after (1, 2): 3 three times; after (1, 2, 3): 4 twice, 5 once; then 9
    assert proposer.propose([("a", tokens)], 4)[0] == [3, 4, 9, 1]
    assert SuffixProposer(max_depth=8, min_token_prob=0.3).propose([("a", tokens)], 4)[0] == [3, 4]  # 2-token match
    assert SuffixProposer(max_depth=8, min_token_prob=0.7, spec_factor=2.0).propose([("a", tokens)], 4)[0] == [3]
    tokens += [3, 7]  # grows incrementally
    assert proposer.propose([("a", tokens)], 4)[0] == []  # (3, 7) never seen before


def test_suffix_learns_from_finished_requests_and_forgets_the_oldest():
    proposer = SuffixProposer(max_depth=6, min_token_prob=0.5, spec_factor=2.0, max_cached_requests=1)
    proposer.finish("old", [10, 11, 12, 13, 14])
    assert proposer.propose([("new", [7, 10, 11])], 3)[0] == [12, 13, 14]
    proposer.finish("new", [7, 10, 11, 20])
    # the first request's tokens were dropped: only the second one is known
    assert proposer.propose([("newer", [10])], 3)[0] == [11, 20]
    assert list(proposer.cached) == ["new"] and "new" not in proposer.local


def test_suffix_reset_forgets_finished_requests_but_not_running_ones():
    proposer = SuffixProposer(max_depth=6, min_token_prob=0.5, spec_factor=2.0)
    proposer.finish("old", [10, 11, 12, 13, 14])
    assert proposer.propose([("running", [1, 2, 3, 1, 2])], 2)[0] == [3, 1]
    proposer.reset()
    assert proposer.propose([("new", [7, 10, 11])], 3)[0] == []
    assert proposer.propose([("running", [1, 2, 3, 1, 2])], 2)[0] == [3, 1]
    assert not proposer.cached and proposer.global_trie.nodes_in_use() == 0


def test_suffix_trie_removal_leaves_nothing_behind():
    trie = SuffixTrie(max_depth=4)
    trie.add([1, 2, 1, 2, 3])
    trie.add([2, 3, 4])
    assert trie.count([2]) == 3 and trie.count([2, 3]) == 2 and trie.count([1, 2, 1]) == 1
    used = trie.nodes_in_use()
    trie.remove([1, 2, 1, 2, 3])
    assert trie.count([2]) == 1 and trie.count([1]) == 0 and trie.count([2, 3, 4]) == 1
    trie.add([1, 2, 1, 2, 3])  # the dropped nodes come back into use
    assert trie.nodes_in_use() == used and len(trie.counts) == used + 1
    trie.remove([1, 2, 1, 2, 3])
    trie.remove([2, 3, 4])
    assert trie.nodes_in_use() == 0 and trie.children[trie.ROOT] == {} and trie.totals[trie.ROOT] == 0


def test_suffix_shares_after_forgetting_a_request_are_those_of_the_requests_kept():
    """A draft's shares (each child's count over its siblings') after the oldest finished request is dropped
    equal those of a proposer that only ever saw the requests kept."""
    kept = [[5, 6, 7, 5, 6, 8], [5, 6, 8, 1]]
    evicting = SuffixProposer(max_depth=6, min_token_prob=0.6, spec_factor=2.0, max_cached_requests=2)
    fresh = SuffixProposer(max_depth=6, min_token_prob=0.6, spec_factor=2.0, max_cached_requests=2)
    evicting.finish("dropped", [5, 6, 7, 5, 6, 7, 5, 6, 7])  # makes 7 the favourite after (5, 6)
    for i, tokens in enumerate(kept):
        evicting.finish(f"kept{i}", tokens)
        fresh.finish(f"kept{i}", tokens)
    # after (5, 6): 8 twice of three; 0.67 >= 0.6, then 1 (its only child) keeps the share
    assert evicting.propose([("q", [5, 6])], 3)[0] == fresh.propose([("q", [5, 6])], 3)[0] == [8, 1]
