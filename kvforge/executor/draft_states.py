"""A hybrid draft model's linear-attention states (executor/draft_runner.py): two slots per request the draft runs for.

The kept slot holds the state after the request's tokens so far: a proposal's catch-up forward advances it over the
request's new tokens (the target's accepted drafts and its own token), and it never sees a draft. The drafts run one
position at a time through the working slot, a copy of the kept one taken after the catch-up, so whichever drafts
the target rejects, the kept state is right:

    request of n tokens     kept slot    state after tokens 0..n-1      (catch-up from the previous proposal's n)
                            working      kept, then d0, d1, ..., d(m-2)   (decode steps; dropped afterwards)

Requests take a pair of slots when the draft first runs for them and give it back when they finish or are preempted;
at most max_num_seqs run at once. The last slot is the padding rows' of a compiled decode step (no request's).
"""

from __future__ import annotations

import numpy as np
import torch

from kvforge.layers.recurrent_state_spec import RecurrentStateSpec


class DraftStates:
    """Per linear-attention layer of the draft, (conv_state, delta_state) of 2 * max_num_seqs + 1 slots: request
    pair i is slots 2i (kept) and 2i + 1 (working)."""

    def __init__(self, spec: RecurrentStateSpec, max_num_seqs: int, dtype: torch.dtype, device: torch.device) -> None:
        self.layers = spec.allocate(2 * max_num_seqs + 1, dtype, device)
        self.padding_slot = 2 * max_num_seqs
        self.device = device
        self.pair_of: dict[str, int] = {}
        self.free_pairs = list(range(max_num_seqs - 1, -1, -1))  # a stack, pair 0 on top

    @staticmethod
    def bytes_per_request(spec: RecurrentStateSpec, dtype: torch.dtype) -> int:
        """What a running request's pair of slots takes."""
        return 2 * spec.bytes_per_slot(dtype)

    def slots(self, request_ids: list[str]) -> np.ndarray:
        """The requests' kept slots [requests] (a request met anew takes a free pair)."""
        for request_id in request_ids:
            if request_id not in self.pair_of:
                assert self.free_pairs, "more requests draft at once than the draft's state slots"
                self.pair_of[request_id] = self.free_pairs.pop()
        return np.array([2 * self.pair_of[r] for r in request_ids], dtype=np.int64)

    def working_copies(self, kept: np.ndarray) -> np.ndarray:
        """The working slots [requests] of kept slots, each now holding its kept slot's state."""
        working = kept + 1
        source, target = (torch.from_numpy(s).to(self.device) for s in (kept, working))
        for conv_state, delta_state in self.layers:
            conv_state[target] = conv_state[source]
            delta_state[target] = delta_state[source]
        return working

    def forget(self, request_ids: list[str]) -> None:
        """The requests finished or were preempted: their pairs are free."""
        for request_id in request_ids:
            pair = self.pair_of.pop(request_id, None)
            if pair is not None:
                self.free_pairs.append(pair)
