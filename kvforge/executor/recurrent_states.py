"""The runner's linear-attention states (a hybrid model's): one slot per running request, and under speculative
decoding the states after each token of a verification step, to keep those of the accepted tokens only.

A verification step runs a drafting request's last token and its k drafts (positions p .. p + k) through the linear
layers one position at a time, and keeps the state after each in the scratch (position j's in scratch[j]). Which
drafts were accepted is known on the rank that samples; every rank learns it from the next step, where the request's
num_computed_tokens is p + 1 + n for n accepted drafts: its slot then takes scratch[n] (the state after its last
token and the n drafts), before the step runs.

    verification step      tokens   t_p  d1  d2  d3         state of the slot after t_p d1 d2 d3 (in place)
                           scratch  [0]  [1] [2] [3]        after t_p, t_p d1, ...
    next step (n = 1)      slot <- scratch[1]               the state after t_p d1
"""

from __future__ import annotations

import numpy as np
import torch

from kvforge.layers.recurrent_state_spec import RecurrentStateSpec
from kvforge.step_data import ScheduledRequest


class RecurrentStates:
    """Per linear-attention layer, (conv_state, delta_state) of num_slots slots and the padding slot, and with
    max_draft_tokens > 0 their scratch [max_draft_tokens + 1, num_slots + 1, ...] after them (what the layer's cache
    tuple holds). The padding slot (padding_slot, after the requests' slots) is the one the padding rows of a
    compiled decode step read and write (executor/decode_graphs.py): no request's. checkpoints: num_checkpoints states
    kept for prefix-cache hits (engine/state_checkpoints.py), per layer (conv_state, delta_state)."""

    def __init__(self, spec: RecurrentStateSpec, num_slots: int, max_draft_tokens: int, dtype: torch.dtype,
                 device: torch.device, num_checkpoints: int = 0) -> None:
        assert num_slots > 0, "a model with linear-attention layers needs state slots"
        self.device = device
        self.padding_slot = num_slots
        self.layers = spec.allocate(num_slots + 1, dtype, device)
        self.checkpoints = spec.allocate(num_checkpoints, dtype, device) if num_checkpoints else []
        if max_draft_tokens > 0:
            scratch = spec.allocate(num_slots + 1, dtype, device, copies=(max_draft_tokens + 1,))
            self.layers = [state + extra for state, extra in zip(self.layers, scratch, strict=True)]
        # request id -> (its slot, num_computed_tokens at its verification step): the state to take from the scratch
        self.pending: dict[str, tuple[int, int]] = {}

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.pending.pop(request_id, None)

    def load_checkpoints(self, scheduled: list[ScheduledRequest], slot_ids: list[int]) -> None:
        """Before a step: the slots of prefix-cache hits take their checkpoints' states."""
        pairs = [(slot, s.load_state_from) for s, slot in zip(scheduled, slot_ids, strict=True)
                 if s.load_state_from is not None]
        if pairs:
            self._copy(pairs, self.checkpoints, self.layers)

    def save_checkpoints(self, scheduled: list[ScheduledRequest], slot_ids: list[int]) -> None:
        """After a step: the checkpoints to save take the states of their requests' slots."""
        pairs = [(s.save_state_to, slot) for s, slot in zip(scheduled, slot_ids, strict=True)
                 if s.save_state_to is not None]
        if pairs:
            self._copy(pairs, self.layers, self.checkpoints)

    def _copy(self, pairs: list[tuple[int, int]], source: list[tuple[torch.Tensor, ...]],
              target: list[tuple[torch.Tensor, ...]]) -> None:
        """Per (target index, source index) of pairs: every layer's conv and delta state."""
        to_index, from_index = (torch.tensor(list(column), device=self.device) for column in zip(*pairs, strict=True))
        for (source_conv, source_delta, *_), (target_conv, target_delta, *_) in zip(source, target, strict=True):
            target_conv[to_index] = source_conv[from_index]
            target_delta[to_index] = source_delta[from_index]

    def commit_accepted(self, scheduled: list[ScheduledRequest]) -> None:
        """Before a step: a request verified in its previous step takes the state after its accepted drafts."""
        taken = [(slot, s.num_computed_tokens - start - 1) for s in scheduled
                 if (entry := self.pending.pop(s.request_id, None)) is not None for slot, start in [entry]]
        if not taken:
            return
        slots = torch.tensor([slot for slot, _ in taken], device=self.device)
        positions = torch.tensor([position for _, position in taken], device=self.device)
        for conv_state, delta_state, conv_scratch, delta_scratch in self.layers:
            conv_state[slots] = conv_scratch[positions, slots]
            delta_state[slots] = delta_scratch[positions, slots]

    def verification_rows(self, scheduled: list[ScheduledRequest], slot_ids: list[int], q_lens: np.ndarray,
                          query_start_loc: np.ndarray) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """For a step with drafts: per position j of the step's tokens, (the rows of the sequences' j-th tokens,
        those sequences' indices); and the drafting requests' scratch to commit in their next step."""
        for s, slot in zip(scheduled, slot_ids, strict=True):
            if s.num_draft_tokens:
                self.pending[s.request_id] = (slot, s.num_computed_tokens)
        to_device = lambda a: torch.from_numpy(a).to(self.device, non_blocking=True)  # noqa: E731
        rows = []
        for position in range(int(q_lens.max())):
            seqs = np.flatnonzero(q_lens > position)
            rows.append((to_device(query_start_loc[seqs].astype(np.int64) + position), to_device(seqs)))
        return tuple(rows)
