"""The runner's requests as rows of preallocated arrays, kept between steps, from which each step's flat inputs are
gathered with a few vectorised numpy operations into one staging buffer (executor/staging.py).

The scheduler sends a request's prompt, generated tokens and sampling parameters once (a NewRequest, when it enters
the running batch), then per step only the tokens to compute and the blocks its tables gained. A request holds one
row from then until it finishes, is aborted or is preempted (a preempted request comes back as a NewRequest); rows
stay dense: a removal moves the last rows into the holes (condense).

    row r (request_ids[r])           0 .. num_prompt[r]-1     .. num_computed[r] ..  num_tokens[r]-1   capacity
    token_ids     [rows, cols] i64   p0 p1 ... p(n-1) | o0 o1 ...  | the step's tokens |  (stale)
    block_tables  [groups, rows, blocks] i32   per paged layer group, 0 .. num_blocks[g, r]-1 (append-only)
    state_slots   [rows] i32          a hybrid model's linear-attention state slot (-1 without one)
    float_params  [rows, 6] f64       temperature top_p min_p presence_penalty frequency_penalty repetition_penalty
    int_params    [rows, 4] i64       top_k logprobs prompt_logprobs min_tokens          (None stored as -1)
    sampling_params, loras, generators: per row, Python objects (rows move with their requests)
    token_lists   per row, its tokens as a Python list for the sampler's penalties, brought up to date only when
                  read: list_valid[r] of them still match token_ids (a step rewinds it to its first position)

A step schedules requests s = 0 .. N-1 in the scheduler's order, at rows rows[s]; its T tokens, flat:

    token t of request s, at position p = num_computed[rows[s]] + (t - query_start_loc[s]):
    input_ids[t]          = token_ids[rows[s], p]
    slot_mapping[g][t]    = block_tables[g, rows[s], p // block_size] * block_size + p % block_size
    block_tables[g] (step) = block_tables[g, rows, :max over s of num_blocks[g, rows[s]]]       [N, width_g]

A step of decodes with drafts lays them out as one sequence per token row (row p of a sequence sees its first
p + 1 tokens: causal attention over the step's queries): block tables per token row, seq_lens = positions + 1.

A seeded request's generator outlives a preemption (it is dropped when the request finishes), so its samples do not
depend on whether it was preempted; the other requests draw from the engine's generator (`engine_generator`),
never from torch's global one.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np
import torch

from kvforge.executor.staging import StagingBuffer
from kvforge.layers.sampler import SamplingBatch
from kvforge.lora.request import LoRARequest
from kvforge.sampling_params import SamplingParams
from kvforge.step_data import ScheduledRequest, SchedulerOutput

# the SamplingParams fields of the columns of float_params and int_params (one gather each per step)
FLOAT_PARAMS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
INT_PARAMS = ("top_k", "logprobs", "prompt_logprobs", "min_tokens")


@dataclass(slots=True)
class StepInputs:
    """One step's flat inputs on the device (views of the staging buffer) and the host arrays the runner reads."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    group_tables: list[tuple[torch.Tensor, torch.Tensor]]  # per paged group: (slot_mapping [T] i64, tables [rows, w])
    query_start_loc: torch.Tensor  # [rows + 1] int32
    seq_lens: torch.Tensor  # [rows] int32
    state_slot_ids: torch.Tensor | None  # [N] int32 (a hybrid model's)
    has_initial_state: torch.Tensor | None  # [N] bool
    decode_only: bool
    q_lens: np.ndarray  # [N] host: tokens per request
    starts: np.ndarray  # [N + 1] host: query_start_loc per request
    computed: np.ndarray  # [N] host: num_computed_tokens per request


@dataclass(slots=True)
class _Settings:
    """The sampling settings of a list of rows; shared by the steps that sample them: read only."""

    rows: list[int]
    fields: dict[str, list | None]  # SamplingBatch's per-row settings by keyword, one entry a row
    penalized: bool  # some row has a penalty (the sampler reads the prompt and output tokens)


class InputBatch:
    """The runner's requests by row; `update(output)` applies a step's changes before it runs, `inputs(rows,
    num_draft_tokens)` lays out its flat inputs. num_groups: the paged layer groups of the KV cache; has_states: a
    hybrid model's requests each hold a recurrent-state slot (the last group of new_block_ids)."""

    def __init__(self, num_groups: int, block_size: int, device: torch.device, seed: int = 0,
                 has_states: bool = False, max_num_reqs: int = 8, max_model_len: int = 256) -> None:
        self.num_groups = num_groups
        self.block_size = block_size
        self.has_states = has_states
        self.engine_generator = torch.Generator(device).manual_seed(seed)
        self.device = device
        self.staging = StagingBuffer(device)
        self.request_ids: list[str] = []  # per row
        self.row_of: dict[str, int] = {}
        self.sampling_params: list[SamplingParams] = []
        self.loras: list[LoRARequest | None] = []
        self.token_lists: list[list[int]] = []
        self.generators: dict[str, torch.Generator] = {}  # seeded requests' (kept across a preemption)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.block_tables = np.zeros((num_groups, max_num_reqs, 16), dtype=np.int32)
        self.num_blocks = np.zeros((num_groups, max_num_reqs), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt = np.zeros(max_num_reqs, dtype=np.int64)
        self.state_slots = np.full(max_num_reqs, -1, dtype=np.int64)
        self.list_valid = np.zeros(max_num_reqs, dtype=np.int64)
        self.float_params = np.zeros((max_num_reqs, len(FLOAT_PARAMS)), dtype=np.float64)
        self.int_params = np.zeros((max_num_reqs, len(INT_PARAMS)), dtype=np.int64)
        self.num_prompt_logprobs = 0  # rows asking for prompt logprobs (none: a step skips looking for them)
        self._advanced: tuple[list[ScheduledRequest], np.ndarray] | None = None  # the latest step's (requests, rows)
        self._settings_at: _Settings | None = None  # the latest sampling settings gathered (None: a row changed since)

    @property
    def num_reqs(self) -> int:
        return len(self.request_ids)

    def _row_arrays(self) -> list[np.ndarray]:
        """The per-row arrays a row's move copies whole (token_ids and the block tables are copied apart)."""
        return [self.num_tokens, self.num_computed, self.num_prompt, self.state_slots, self.list_valid,
                self.float_params, self.int_params]

    # ---- the requests ------------------------------------------------------------------------------------------

    def update(self, output: SchedulerOutput) -> None:
        """Drop the finished and preempted requests (condensing the rows), add the new ones, then apply each
        scheduled request's share of the step: its tokens from num_computed_tokens on, the blocks its tables gained."""
        for request_id in output.finished_request_ids:
            self.generators.pop(request_id, None)
        self.remove(output.finished_request_ids + output.preempted_request_ids)
        for new in output.new_requests:
            self._add(new.request_id, new.token_ids, new.num_prompt_tokens, new.sampling_params, new.lora)
        if output.scheduled:
            self._advance(output.scheduled)

    def forget(self, request_ids: list[str]) -> None:
        """Drop requests (finished ones: their generators too)."""
        for request_id in request_ids:
            self.generators.pop(request_id, None)
        self.remove(request_ids)

    def remove(self, request_ids: list[str]) -> None:
        """Free the rows of these requests (unknown ids are ignored), then condense: the last rows fill the holes."""
        holes = sorted(row for row in (self.row_of.pop(r, None) for r in request_ids) if row is not None)
        if not holes:
            return
        self._advanced = self._settings_at = None
        self.num_prompt_logprobs -= int((self.int_params[holes, 2] >= 0).sum())
        num_left = self.num_reqs - len(holes)
        gone = set(holes)
        movers = [row for row in range(num_left, self.num_reqs) if row not in gone]
        for hole, row in zip(holes, movers):  # holes below num_left, as many as rows above it still live
            self._move(row, hole)
        del self.request_ids[num_left:], self.sampling_params[num_left:], self.loras[num_left:]
        del self.token_lists[num_left:]

    def _move(self, row: int, to: int) -> None:
        for array in self._row_arrays():
            array[to] = array[row]
        self.token_ids[to, : self.num_tokens[row]] = self.token_ids[row, : self.num_tokens[row]]
        self.block_tables[:, to] = self.block_tables[:, row]
        self.num_blocks[:, to] = self.num_blocks[:, row]
        for per_row in (self.request_ids, self.sampling_params, self.loras, self.token_lists):
            per_row[to] = per_row[row]
        self.row_of[self.request_ids[to]] = to

    def _add(self, request_id: str, token_ids: list[int], num_prompt: int, params: SamplingParams,
             lora: LoRARequest | None) -> None:
        row = self.num_reqs
        self._settings_at = None
        self._reserve(row + 1, len(token_ids), 0)
        self.request_ids.append(request_id)
        self.sampling_params.append(params)
        self.loras.append(lora)
        self.token_lists.append(list(token_ids))
        self.row_of[request_id] = row
        self.token_ids[row, : len(token_ids)] = token_ids
        self.num_tokens[row] = self.num_computed[row] = self.list_valid[row] = len(token_ids)
        self.num_prompt[row] = num_prompt
        self.num_blocks[:, row] = 0
        self.block_tables[:, row] = 0  # a step's tables are padded with the null block past a request's blocks
        self.state_slots[row] = -1
        self.float_params[row] = [getattr(params, name) for name in FLOAT_PARAMS]
        self.int_params[row] = [-1 if (value := getattr(params, name)) is None else value for name in INT_PARAMS]
        self.num_prompt_logprobs += params.prompt_logprobs is not None
        if params.seed is not None and request_id not in self.generators:
            self.generators[request_id] = torch.Generator(self.device).manual_seed(params.seed)

    def _advance(self, scheduled: list[ScheduledRequest]) -> None:
        """Each request's tokens replace whatever followed its first position; its tables gain their new blocks."""
        # NOTE: lists and builtins, not numpy reductions: right after a model step a numpy call costs more than a walk
        # over a few dozen requests
        row_list = [self.row_of[s.request_id] for s in scheduled]
        start_list = [s.num_computed_tokens for s in scheduled]
        lengths = [len(s.token_ids) for s in scheduled]
        rows = np.array(row_list, dtype=np.int64)
        self._advanced = scheduled, rows
        assert all(map(operator.le, start_list, self.num_tokens[rows].tolist())), (
            "a step starts past the tokens the runner holds")
        starts = np.array(start_list, dtype=np.int64)
        ends = starts + lengths
        self._reserve(self.num_reqs, max(map(operator.add, start_list, lengths)), 0)
        if lengths.count(1) == len(lengths):  # decodes: one token each, written at once
            self.token_ids[rows, starts] = [s.token_ids[0] for s in scheduled]
        else:
            for row, start, s in zip(row_list, start_list, scheduled):
                self.token_ids[row, start : start + len(s.token_ids)] = s.token_ids
        self.num_computed[rows], self.num_tokens[rows] = starts, ends
        self.list_valid[rows] = np.minimum(self.list_valid[rows], starts)
        for row, s in zip(row_list, scheduled):
            if any(s.new_block_ids):  # most decode steps gain no block
                self._add_blocks(row, s.new_block_ids)

    def rows_of(self, requests: list[ScheduledRequest]) -> np.ndarray:
        """The rows of these requests (those of the latest update's scheduled list without a lookup)."""
        if self._advanced is not None and self._advanced[0] is requests:
            return self._advanced[1]
        return np.fromiter((self.row_of[s.request_id] for s in requests), dtype=np.int64, count=len(requests))

    def _add_blocks(self, row: int, new_block_ids: list[list[int]]) -> None:
        assert len(new_block_ids) == self.num_groups + self.has_states, "new_block_ids per layer group"
        widths = self.num_blocks[:, row] + [len(ids) for ids in new_block_ids[: self.num_groups]]
        self._reserve(row + 1, 0, int(widths.max()))
        for group, ids in enumerate(new_block_ids[: self.num_groups]):
            if ids:
                self.block_tables[group, row, self.num_blocks[group, row] : widths[group]] = ids
        self.num_blocks[:, row] = widths
        if self.has_states and new_block_ids[-1]:  # NOTE: a recurrent-state group's "table" is [slot]
            self.state_slots[row] = new_block_ids[-1][0]

    def _reserve(self, rows: int, cols: int, blocks: int) -> None:
        """Grow the arrays (doubling) to hold rows rows of cols tokens and blocks blocks per group."""
        if rows > len(self.num_tokens):
            size = max(rows, 2 * len(self.num_tokens))
            for name in ("num_tokens", "num_computed", "num_prompt", "state_slots", "list_valid"):
                setattr(self, name, _resized(getattr(self, name), (size,)))
            self.float_params = _resized(self.float_params, (size, len(FLOAT_PARAMS)))
            self.int_params = _resized(self.int_params, (size, len(INT_PARAMS)))
            self.num_blocks = _resized(self.num_blocks, (self.num_groups, size))
            self.token_ids = _resized(self.token_ids, (size, self.token_ids.shape[1]))
            self.block_tables = _resized(self.block_tables, (self.num_groups, size, self.block_tables.shape[2]))
        if cols > self.token_ids.shape[1]:
            self.token_ids = _resized(self.token_ids, (len(self.token_ids), max(cols, 2 * self.token_ids.shape[1])))
        if blocks > self.block_tables.shape[2]:
            shape = (self.num_groups, self.block_tables.shape[1], max(blocks, 2 * self.block_tables.shape[2]))
            self.block_tables = _resized(self.block_tables, shape)

    # ---- what a request holds ------------------------------------------------------------------------------------

    def _token_list(self, row: int) -> list[int]:
        """The row's tokens as a list: its list, with the tokens past list_valid replaced from token_ids."""
        tokens, valid, end = self.token_lists[row], int(self.list_valid[row]), int(self.num_tokens[row])
        if valid != len(tokens) or valid != end:
            del tokens[valid:]
            tokens.extend(self.token_ids[row, valid:end].tolist())
            self.list_valid[row] = end
        return tokens

    def token_list(self, request_id: str) -> list[int]:
        """The request's tokens (none for a request the runner does not hold, such as one aborted while preempted)."""
        row = self.row_of.get(request_id)
        return [] if row is None else self._token_list(row)

    def append_sampled(self, request_id: str, num_draft_tokens: int, sampled_token_ids: list[int]) -> list[int]:
        """After a step that sampled (on the sampling rank, with a draft proposer): the row's last num_draft_tokens
        tokens (drafts) give way to the tokens sampled (the accepted drafts and one more); returns the request's
        tokens so far. The next step overwrites from its first position on, as ever."""
        row = self.row_of[request_id]
        start = int(self.num_tokens[row]) - num_draft_tokens
        end = start + len(sampled_token_ids)
        self._reserve(self.num_reqs, end, 0)
        self.token_ids[row, start:end] = sampled_token_ids
        self.num_tokens[row] = end
        self.list_valid[row] = min(int(self.list_valid[row]), start)
        return self._token_list(row)

    def prompt_token_ids(self, row: int) -> list[int]:
        """The prompt's tokens the runner holds (a chunked prompt's: up to the latest chunk)."""
        return self._token_list(row)[: self.num_prompt[row]]

    def min_tokens(self, request_id: str) -> int:
        return int(self.int_params[self.row_of[request_id], 3])

    def output_token_ids(self, row: int, num_draft_tokens: int = 0) -> list[int]:
        """The generated tokens without the latest step's last num_draft_tokens (drafts still to verify)."""
        tokens = self._token_list(row)
        return tokens[self.num_prompt[row] : len(tokens) - num_draft_tokens]

    def _settings(self, row_list: list[int]) -> _Settings:
        """The sampling settings at these rows, gathered from the arrays; kept for the next step's rows if they are
        the same (NOTE: most steps sample the same requests as the step before, and the gather costs more than the
        rest of the sampling batch)."""
        if self._settings_at is not None and self._settings_at.rows == row_list:
            return self._settings_at
        rows = np.array(row_list, dtype=np.int64)
        (temperatures, top_ps, min_ps, presence, frequency, repetition) = self.float_params[rows].T.tolist()
        top_ks, num_logprobs, _, _ = self.int_params[rows].T.tolist()
        logit_biases = [self.sampling_params[row].logit_bias for row in row_list]
        fields = {"temperatures": temperatures, "top_ks": top_ks, "top_ps": top_ps, "min_ps": min_ps,
                  "presence_penalties": presence, "frequency_penalties": frequency, "repetition_penalties": repetition,
                  "num_logprobs": [None if k < 0 else k for k in num_logprobs],
                  "logit_biases": logit_biases if any(logit_biases) else None}  # None: no row has one
        self._settings_at = _Settings(
            row_list, fields, any(presence) or any(frequency) or repetition.count(1.0) != len(repetition))
        return self._settings_at

    def sampling_batch(self, requests: list[ScheduledRequest], allowed_token_bitmask: torch.Tensor | None
                       ) -> SamplingBatch:
        """The sampling settings of the requests that sample this step, one row each, gathered from the arrays. The
        prompt and output tokens are listed only where something reads them (penalties, drafts to verify)."""
        row_list = self.rows_of(requests).tolist()
        settings = self._settings(row_list)
        if settings.penalized or any([s.num_draft_tokens for s in requests]):
            prompt_token_ids = [self.prompt_token_ids(row) for row in row_list]
            output_token_ids = [self.output_token_ids(row, s.num_draft_tokens) for row, s in zip(row_list, requests)]
        else:
            prompt_token_ids = output_token_ids = [[] for _ in row_list]
        return SamplingBatch(
            **settings.fields,
            prompt_token_ids=prompt_token_ids,
            output_token_ids=output_token_ids,
            banned_token_ids=[s.banned_token_ids for s in requests],
            generators=[self.generators.get(s.request_id) for s in requests] if self.generators
            else [None] * len(requests),
            allowed_token_bitmask=allowed_token_bitmask,
            generator=self.engine_generator,
        )

    # ---- a step's flat inputs ------------------------------------------------------------------------------------

    def inputs(self, rows: np.ndarray, num_draft_tokens: np.ndarray | None = None) -> StepInputs:
        """The flat inputs of a step that schedules the requests at rows (in the step's order), each with its
        num_draft_tokens (None: none has drafts): laid out in the staging buffer and sent to the device in one copy."""
        computed = self.num_computed[rows]
        q_lens = self.num_tokens[rows] - computed
        q_len_list = q_lens.tolist()
        num_seqs, num_tokens = len(q_len_list), sum(q_len_list)
        if num_draft_tokens is None:
            decode_only = q_len_list.count(1) == num_seqs
        else:
            decode_only = bool((q_lens == 1 + num_draft_tokens).all())
        per_token = decode_only and num_tokens > num_seqs  # decodes with drafts: a sequence per token row
        num_rows = num_tokens if per_token else num_seqs
        widths = [max(self.num_blocks[group, rows].tolist(), default=0) for group in range(self.num_groups)]
        parts = {"input_ids": (np.int64, (num_tokens,)), "positions": (np.int64, (num_tokens,)),
                 "query_start_loc": (np.int32, (num_rows + 1,)), "seq_lens": (np.int32, (num_rows,))}
        for group in range(self.num_groups):
            parts[f"slot_mapping{group}"] = (np.int64, (num_tokens,))
            parts[f"block_tables{group}"] = (np.int32, (num_rows, widths[group]))
        if self.has_states:
            parts |= {"state_slot_ids": (np.int32, (num_seqs,)), "has_initial_state": (np.bool_, (num_seqs,))}
        host = self.staging.layout(parts)
        positions = host["positions"]
        if num_tokens == num_seqs:  # a token per request (decodes, last prompt tokens)
            starts = np.arange(num_seqs + 1)
            positions[:] = computed
            row_of_token = rows
        else:
            starts = np.zeros(num_seqs + 1, dtype=np.int64)
            np.cumsum(q_lens, out=starts[1:])
            np.subtract(np.arange(num_tokens), np.repeat(starts[:-1] - computed, q_lens), out=positions)
            row_of_token = np.repeat(rows, q_lens)
        np.take(self.token_ids, row_of_token * self.token_ids.shape[1] + positions, out=host["input_ids"])
        table_rows = row_of_token if per_token else rows
        for group in range(self.num_groups):
            tables = self.block_tables[group]
            slots = host[f"slot_mapping{group}"]  # int64: block ids * block_size may pass 2**31
            slots[:] = np.take(tables, row_of_token * tables.shape[1] + positions // self.block_size)
            slots *= self.block_size
            slots += positions % self.block_size
            host[f"block_tables{group}"][:] = tables[table_rows, : widths[group]]
        if per_token:
            host["query_start_loc"][:] = np.arange(num_tokens + 1)
            np.add(positions, 1, out=host["seq_lens"], casting="unsafe")
        else:
            host["query_start_loc"][:] = starts
            host["seq_lens"][:] = computed + q_lens
        if self.has_states:
            host["state_slot_ids"][:] = self.state_slots[rows]
            np.greater(computed, 0, out=host["has_initial_state"])
        sent = self.staging.send()
        group_tables = [(sent[f"slot_mapping{g}"], sent[f"block_tables{g}"]) for g in range(self.num_groups)]
        return StepInputs(sent["input_ids"], sent["positions"], group_tables, sent["query_start_loc"],
                          sent["seq_lens"], sent.get("state_slot_ids"), sent.get("has_initial_state"), decode_only,
                          q_lens, starts, computed)


def _resized(array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A larger array of the same dtype with array's contents in its leading corner (zeros elsewhere)."""
    grown = np.zeros(shape, dtype=array.dtype)
    grown[tuple(slice(0, n) for n in array.shape)] = array
    return grown
