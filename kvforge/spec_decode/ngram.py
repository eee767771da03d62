"""Prompt lookup: continue the request as it continued the last time its latest tokens appeared."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """Matches the last n tokens (n from max_n down to min_n) against the request's earlier tokens (prompt
    and output) and proposes the tokens that followed the most recent earlier occurrence."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, "
                             f"got {min_n} and {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: Sequence[tuple[str, Sequence[int]]], max_num_tokens: int) -> list[list[int]]:
        """Each request's drafts (its id unused: the proposer keeps no state)."""
        return [self._propose(token_ids, max_num_tokens) for _, token_ids in requests]

    def _propose(self, token_ids: Sequence[int], max_num_tokens: int) -> list[int]:
        num_tokens = len(token_ids)
        if max_num_tokens <= 0 or num_tokens <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            # start i of an earlier occurrence of the last n tokens: tokens[i : i + n], followed by tokens[i + n]
            num_starts = num_tokens - n
            match = tokens[:num_starts] == tokens[num_tokens - n]
            for j in range(1, n):
                match &= tokens[j : num_starts + j] == tokens[num_tokens - n + j]
            starts = np.flatnonzero(match)
            if len(starts):
                follow = int(starts[-1]) + n
                return tokens[follow : follow + max_num_tokens].tolist()
        return []

    def finish(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Nothing to forget: the proposer keeps no state."""

    def reset(self) -> None:
        """Nothing to forget: the proposer keeps no state."""
