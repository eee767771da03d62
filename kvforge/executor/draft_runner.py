"""The draft model of speculative decoding, run by the model runner on its sampling rank: after each step it drafts
the next step's tokens of every request that asks for drafts, all requests at once, and keeps the distributions
it sampled them from on the device for the rejection sampler of the step that verifies them.

Its paged KV cache has as many blocks as the target's and the same block size, and a request's draft KV lives in
the blocks of the request's first (full-attention) group's block table: the blocks the scheduler allocates for the
target hold the draft's keys and values too, and are freed with them (finished, aborted, preempted). The scheduler
allocates up to num_speculative_tokens slots past a proposing request's step (lookahead) for the draft's own tokens.
Every layer of the draft keeps its keys in those blocks, its sliding-window layers too (they read their window of
them); a hybrid draft's linear-attention layers keep their states in slots of their own (DraftStates).

A proposal for a request of n tokens, m drafts:

    position        start .. n-1           n        n+1     ..  n+m-2
    draft input     the request's tokens   d0       d1          d(m-2)      (catch-up, then one token per step)
    draft output                   -> d0   -> d1    -> d2       -> d(m-1)

    forwards: 1 (every request's new tokens, one flat batch; more where they pass max_num_batched_tokens)
              + m-1 (one token per request each: decode steps, compiled as the target's are)

The draft's keys and values of the request's tokens stay valid while its tokens grow: start is the first position
whose cache the draft has not filled with the token the request holds there (its earlier drafts that the target
accepted count as filled, except in a hybrid draft, whose state holds no drafts). A request the runner meets anew
(new, or back after a preemption) starts at 0: a prefix-cache hit of the target says nothing of the draft's cache.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from kvforge.executor.decode_graphs import DecodeGraphs
from kvforge.executor.draft_states import DraftStates
from kvforge.layers.attention import AttentionMetadata
from kvforge.layers.kv_cache_spec import KVCacheSpec
from kvforge.layers.sampler import draw_uniforms
from kvforge.sampling_params import SamplingParams
from kvforge.spec_decode import draft


def draft_paged_spec(spec: KVCacheSpec) -> KVCacheSpec:
    """The draft's paged layers as one group, a cache tensor each: they all write a request's tokens to the same
    blocks (a sliding window's layers read the window of them), so no two layers may share a tensor."""
    return dataclasses.replace(spec, layer_windows=None)


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


@dataclass(frozen=True, slots=True)
class DraftLimits:
    """How long a draft's request may grow (max_model_len), how many requests run at once (max_num_seqs: a hybrid
    draft's state slots) and how many tokens one forward computes (max_num_batched_tokens: the catch-up's chunks)."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int


class DraftRunner:
    """The draft model, its KV cache (spec: the draft's, stored as the target's; num_blocks: the target's block count),
    a hybrid draft's states, and its compiled decode steps (compile_decode_steps; without them every step eager)."""

    def __init__(self, model: nn.Module, spec: KVCacheSpec, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, limits: DraftLimits, seed: int = 0) -> None:
        self.model = model
        self.kv_caches = draft_paged_spec(spec).allocate(num_blocks, block_size, dtype, device)
        self.num_groups = len(spec.layer_groups())  # the groups the model's layers read their tables from
        self.states = None
        if spec.recurrent_state is not None:
            self.states = DraftStates(spec.recurrent_state, limits.max_num_seqs, dtype, device)
            self.kv_caches += self.states.layers
        self.block_size = block_size
        self.device = device
        self.limits = limits
        self.num_blocks = num_blocks
        self.graphs: DecodeGraphs | None = None
        self.generator = torch.Generator(device).manual_seed(seed)  # the unseeded requests' draws
        self.num_computed: dict[str, int] = {}  # request -> its tokens whose draft KV is in the cache
        self.proposals: dict[str, _Proposal] = {}

    def forget(self, request_ids: list[str]) -> None:
        """The requests finished or were preempted: their blocks are gone."""
        for request_id in request_ids:
            self.num_computed.pop(request_id, None)
            self.proposals.pop(request_id, None)
        if self.states is not None:
            self.states.forget(request_ids)

    def compile_decode_steps(self, target_graphs: DecodeGraphs) -> None:
        """Compile the draft's decode steps as the target's are: in target_graphs' buckets, after as many eager steps,
        on their compile thread (the runner's steps, which the proposals run in, lend it its turns)."""
        max_blocks_per_seq = min(self.num_blocks, -(-self.limits.max_model_len // self.block_size))
        padding_slot = None if self.states is None else self.states.padding_slot
        self.graphs = DecodeGraphs(self.model, self.kv_caches, target_graphs.buckets, target_graphs.compile_after,
                                   max_blocks_per_seq, self.device, self.num_groups, padding_slot,
                                   target_graphs.compiler)

    def close(self) -> None:
        """Stop the compiles of the draft's decode steps (the engine is shutting down)."""
        if self.graphs is not None:
            self.graphs.close()

    def draft_probs(self, request_id: str, draft_token_ids: list[int]) -> torch.Tensor | None:
        """The distributions [len(draft_token_ids), vocab] the request's drafts (a prefix of its latest proposal) were
        drawn from, on the device; None for greedy drafts."""
        proposal = self.proposals[request_id]
        assert proposal.token_ids[: len(draft_token_ids)] == draft_token_ids, "drafts the draft model did not propose"
        return None if proposal.probs is None else proposal.probs[: len(draft_token_ids)]

    def _start(self, request_id: str, token_ids: list[int]) -> int:
        """The first position whose draft KV (and state) the request's next proposal computes."""
        computed = self.num_computed.get(request_id, 0)
        if self.states is not None:  # the state is the one after the tokens so far: no drafts in it
            return computed if computed < len(token_ids) else 0
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
        room = min(len(request.block_table) * self.block_size, self.limits.max_model_len) - n + 1
        return max(min(max_num_tokens, room), 0)

    def propose(self, requests: list[DraftRequest], max_num_tokens: int) -> list[list[int]]:
        """Up to max_num_tokens drafts per request (fewer where its blocks end), in one batched catch-up forward of
        the requests' new tokens (chunked to max_num_batched_tokens), then one decode step per further position."""
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
        slots = None if self.states is None else self.states.slots([r.request_id for r in reqs])
        params = [draft.draft_params(r.sampling_params, len(r.token_ids), max_num_tokens) for r in reqs]
        generators = draft.draft_generators(params, self.device)
        sampled = any(p.temperature > 0.0 for p in params)
        max_drafts = int(num_drafts.max())
        drafted = torch.zeros((len(reqs), max_drafts), dtype=torch.long, device=self.device)
        probs = None
        logits = self._catch_up([r.token_ids for r in reqs], starts, tables, slots)
        if slots is not None and max_drafts > 1:  # the drafts run through a copy of each state
            slots = self.states.working_copies(slots)
        active = np.arange(len(reqs))
        for j in range(max_drafts):
            if j > 0:  # the previous drafts of the requests that draft further, one token each
                active = active[num_drafts[active] > j]
            index = torch.from_numpy(active).to(self.device)
            if j > 0:
                logits = self._decode(drafted[index, j - 1], num_tokens[active] + j - 1, active, tables, slots)
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

    def _catch_up(self, token_ids: list[list[int]], starts: np.ndarray, tables: np.ndarray,
                  slots: np.ndarray | None) -> torch.Tensor:
        """The draft's fp32 logits [requests, vocab] after each request's tokens, its tokens from starts on computed
        in one flat batch, in forwards of at most max_num_batched_tokens tokens (a request's may span several)."""
        q_lens = np.array([len(t) for t in token_ids], dtype=np.int64) - starts
        ends = np.cumsum(q_lens)  # each request's end in the flat batch
        row_of_token = np.repeat(np.arange(len(token_ids)), q_lens)
        positions = np.arange(int(ends[-1])) - np.repeat(ends - q_lens - starts, q_lens)
        input_ids = torch.from_numpy(np.concatenate([t[s:] for t, s in zip(token_ids, starts.tolist())]))
        logits = []
        budget = self.limits.max_num_batched_tokens
        for first in range(0, int(ends[-1]), budget):
            last = min(first + budget, int(ends[-1]))
            # NOTE: every sequence of a chunk but its last ends in it; that one may go on in the next chunk
            num_ending = int(((ends > first) & (ends <= last)).sum())
            hidden = self._forward(input_ids[first:last], positions[first:last], row_of_token[first:last], tables,
                                   slots)
            logits.append(self.model.compute_logits(hidden[:num_ending]).float())
        return torch.cat(logits)

    def _decode(self, input_ids: torch.Tensor, positions: np.ndarray, rows: np.ndarray, tables: np.ndarray,
                slots: np.ndarray | None) -> torch.Tensor:
        """One token of each of rows (input_ids [rows] on the device, at positions [rows]): fp32 logits [rows, vocab],
        from the bucket's compiled step once it is ready."""
        metadata = self._metadata(positions, rows, tables, slots)
        positions_tensor = torch.from_numpy(positions.astype(np.int64)).to(self.device)
        if self.graphs is not None and self.graphs.bucket_for(len(rows)) is not None:
            logits = self.graphs.run(input_ids, positions_tensor, metadata)
            if logits is not None:
                return logits.float()
        hidden = self.model(input_ids, positions_tensor, self.kv_caches, metadata, None)
        return self.model.compute_logits(hidden).float()

    def _forward(self, input_ids: torch.Tensor, positions: np.ndarray, row_of_token: np.ndarray, tables: np.ndarray,
                 slots: np.ndarray | None) -> torch.Tensor:
        """The draft's hidden states [sequences, hidden] at the last token of each sequence; input_ids [tokens] of the
        sequences of rows row_of_token (ascending, each sequence's tokens together) at positions [tokens]."""
        metadata = self._metadata(positions, row_of_token, tables, slots)
        hidden = self.model(input_ids.to(self.device), torch.from_numpy(positions.astype(np.int64)).to(self.device),
                            self.kv_caches, metadata, None)
        return hidden[metadata.query_start_loc[1:].long() - 1]

    def _metadata(self, positions: np.ndarray, row_of_token: np.ndarray, tables: np.ndarray,
                  slots: np.ndarray | None) -> AttentionMetadata:
        """The attention metadata of tokens at positions of rows row_of_token: every layer group of the draft reads
        and writes the rows' blocks (tables [rows, blocks]); a hybrid draft's states in slots [rows]."""
        rows, q_lens = np.unique(row_of_token, return_counts=True)
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=query_start_loc[1:])
        block_slots = tables[row_of_token, positions // self.block_size].astype(np.int64) * self.block_size
        block_slots += positions % self.block_size
        seq_lens = positions[query_start_loc[1:] - 1] + 1
        device = self.device
        slot_mapping = torch.from_numpy(block_slots).to(device)
        width = int(positions.max()) // self.block_size + 1  # the blocks the rows read
        block_tables = torch.from_numpy(np.ascontiguousarray(tables[rows, :width])).to(device)
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping, query_start_loc=torch.from_numpy(query_start_loc).to(device),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device), block_tables=block_tables,
            decode_only=bool((q_lens == 1).all()), other_groups=((slot_mapping, block_tables),) * (self.num_groups - 1))
        if slots is not None:  # a sequence that starts past position 0 continues its state
            metadata.state_slot_ids = torch.from_numpy(slots[rows].astype(np.int32)).to(device)
            metadata.has_initial_state = torch.from_numpy(positions[query_start_loc[:-1]] > 0).to(device)
        return metadata
