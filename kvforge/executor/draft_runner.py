"""The draft model of speculative decoding, run by the model runner on its sampling rank: after each step it drafts
the next step's tokens of every request that asks for drafts, all requests at once, and keeps the distributions
it sampled them from on the device for the rejection sampler of the step that verifies them.

Its paged KV cache has as many blocks as the target's and the same block size, and a request's draft KV lives in
the blocks of the request's (first group's) block table: the blocks the scheduler allocates for the target hold
the draft's keys and values too, and are freed with them (finished, aborted, preempted). The scheduler allocates
up to num_speculative_tokens slots past a proposing request's step (lookahead) for the draft's own tokens.

A proposal for a request of n tokens, m drafts:

    position        start .. n-1           n        n+1     ..  n+m-2
    draft input     the request's tokens   d0       d1          d(m-2)      (prefill, then one token per step)
    draft output                   -> d0   -> d1    -> d2       -> d(m-1)

    forwards: 1 (every request's new tokens, one flat batch) + m-1 (one token per request each)

The draft's keys and values of the request's tokens stay valid while its tokens grow: start is the first position
whose cache the draft has not filled with the token the request holds there (its earlier drafts that the target
accepted count as filled). A request the runner meets anew (new, or back after a preemption) starts at 0: a
prefix-cache hit of the target says nothing of the draft's cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from kvforge.layers.attention import AttentionMetadata
from kvforge.layers.sampler import draw_uniforms
from kvforge.sampling_params import SamplingParams
from kvforge.spec_decode import draft


@dataclass(slots=True)
class _Proposal:
    """A request's latest drafts: proposed after its first num_tokens tokens, with their distributions [len(token_ids),
    vocab] on the device (None: greedy drafts, one-hot)."""

    num_tokens: int
    token_ids: list[int]
    probs: torch.Tensor | None


@dataclass(slots=True)
class DraftRequest:
    """A request to draft for: its tokens so far, its sampling parameters and its first group's block table."""

    request_id: str
    token_ids: list[int]
    sampling_params: SamplingParams
    block_table: np.ndarray  # [num_blocks] int32


class DraftRunner:
    """The draft model and its KV cache (kv_caches: per layer, allocated with the target's block count)."""

    def __init__(self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, ...]], block_size: int,
                 device: torch.device, max_model_len: int, seed: int = 0) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.max_model_len = max_model_len
        self.generator = torch.Generator(device).manual_seed(seed)  # the unseeded requests' draws
        self.num_computed: dict[str, int] = {}  # request -> its tokens whose draft KV is in the cache
        self.proposals: dict[str, _Proposal] = {}

    def forget(self, request_ids: list[str]) -> None:
        """The requests finished or were preempted: their blocks are gone."""
        for request_id in request_ids:
            self.num_computed.pop(request_id, None)
            self.proposals.pop(request_id, None)

    def draft_probs(self, request_id: str, draft_token_ids: list[int]) -> torch.Tensor | None:
        """The distributions [len(draft_token_ids), vocab] the request's drafts (a prefix of its latest proposal) were
        drawn from, on the device; None for greedy drafts."""
        proposal = self.proposals[request_id]
        assert proposal.token_ids[: len(draft_token_ids)] == draft_token_ids, "drafts the draft model did not propose"
        return None if proposal.probs is None else proposal.probs[: len(draft_token_ids)]

    def _start(self, request_id: str, token_ids: list[int]) -> int:
        """The first position whose draft KV the request's next proposal computes."""
        computed = self.num_computed.get(request_id, 0)
        proposal = self.proposals.get(request_id)
        if proposal is not None:  # drafts 0..m-2 went through the draft at positions n..n+m-2
            kept = 0
            for draft_id, token_id in zip(proposal.token_ids[:-1], token_ids[proposal.num_tokens :]):
                if draft_id != token_id:
                    break
                kept += 1
            computed = max(computed, proposal.num_tokens + kept)
        return min(computed, len(token_ids) - 1)  # the last token's logits are needed either way

    def _num_drafts(self, request: DraftRequest, max_num_tokens: int) -> int:
        """Drafts whose keys and values fit the request's blocks and the model's length (d(m-2) at n+m-2)."""
        n = len(request.token_ids)
        room = min(len(request.block_table) * self.block_size, self.max_model_len) - n + 1
        return max(min(max_num_tokens, room), 0)

    def propose(self, requests: list[DraftRequest], max_num_tokens: int) -> list[list[int]]:
        """Up to max_num_tokens drafts per request (fewer where its blocks end), in one batched forward of the
        requests' new tokens, then one per further draft position."""
        counts = [self._num_drafts(r, max_num_tokens) for r in requests]
        drafting = [i for i, m in enumerate(counts) if m > 0]
        result: list[list[int]] = [[] for _ in requests]
        if not drafting:
            return result
        reqs = [requests[i] for i in drafting]
        num_drafts = np.array([counts[i] for i in drafting], dtype=np.int64)
        num_tokens = np.array([len(r.token_ids) for r in reqs], dtype=np.int64)
        starts = np.array([self._start(r.request_id, r.token_ids) for r in reqs], dtype=np.int64)
        width = max(len(r.block_table) for r in reqs)
        tables = np.zeros((len(reqs), width), dtype=np.int32)  # padded with the null block
        for i, r in enumerate(reqs):
            tables[i, : len(r.block_table)] = r.block_table
        params = [draft.draft_params(r.sampling_params, len(r.token_ids), max_num_tokens) for r in reqs]
        generators = draft.draft_generators(params, self.device)
        sampled = any(p.temperature > 0.0 for p in params)
        max_drafts = int(num_drafts.max())
        drafted = torch.zeros((len(reqs), max_drafts), dtype=torch.long, device=self.device)
        probs = None
        # first forward: every request's tokens from start to n-1
        q_lens = num_tokens - starts
        row_of_token = np.repeat(np.arange(len(reqs)), q_lens)
        positions = np.arange(int(q_lens.sum())) - np.repeat(np.cumsum(q_lens) - q_lens - starts, q_lens)
        input_ids = torch.from_numpy(np.concatenate([r.token_ids[s:] for r, s in zip(reqs, starts.tolist())]))
        active = np.arange(len(reqs))
        index = torch.from_numpy(active).to(self.device)
        for j in range(max_drafts):
            if j > 0:  # the previous drafts of the requests that draft further, one token each
                active = active[num_drafts[active] > j]
                index = torch.from_numpy(active).to(self.device)
                input_ids, row_of_token = drafted[index, j - 1], active
                positions = num_tokens[active] + j - 1
            logits = self._forward(input_ids, positions, row_of_token, tables)
            batch = draft.draft_sampling_batch([params[i] for i in active], [generators[i] for i in active],
                                               self.generator)
            uniform = draw_uniforms([1] * len(active), batch.generators, self.device, self.generator)
            token_ids, step_probs = draft.sample_drafts(logits, batch, uniform)
            drafted[index, j] = token_ids
            if sampled:
                if probs is None:
                    probs = torch.zeros((len(reqs), max_drafts, logits.shape[-1]), device=self.device)
                probs[index, j] = step_probs
        drafted_ids = drafted.tolist()  # the one host sync of a proposal
        for r, (i, request) in enumerate(zip(drafting, reqs)):
            m = int(num_drafts[r])
            result[i] = drafted_ids[r][:m]
            self.num_computed[request.request_id] = int(num_tokens[r])
            q = None if params[r].temperature == 0.0 else probs[r, :m]
            self.proposals[request.request_id] = _Proposal(int(num_tokens[r]), result[i], q)
        return result

    def _forward(self, input_ids: torch.Tensor, positions: np.ndarray, row_of_token: np.ndarray,
                 tables: np.ndarray) -> torch.Tensor:
        """The draft's fp32 logits [sequences, vocab] at the last token of each sequence; input_ids [tokens] of the
        sequences of rows row_of_token (ascending, each sequence's tokens together) at positions [tokens]."""
        rows, q_lens = np.unique(row_of_token, return_counts=True)
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=query_start_loc[1:])
        slots = tables[row_of_token, positions // self.block_size].astype(np.int64) * self.block_size
        slots += positions % self.block_size
        seq_lens = positions[query_start_loc[1:] - 1] + 1
        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(device),
            query_start_loc=torch.from_numpy(query_start_loc).to(device),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
            block_tables=torch.from_numpy(np.ascontiguousarray(tables[rows])).to(device),
            decode_only=bool((q_lens == 1).all()))
        hidden = self.model(input_ids.to(device), torch.from_numpy(positions.astype(np.int64)).to(device),
                            self.kv_caches, metadata, None)
        return self.model.compute_logits(hidden[torch.from_numpy(query_start_loc[1:] - 1).to(device)]).float()
