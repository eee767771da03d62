"""InputBatch stepped by hand: requests added, advanced, preempted, finished and condensed; each step's flat inputs
equal what a plain per-request construction (below, token by token) gives from the same requests.

Block size 4, two paged layer groups and a recurrent-state slot (a hybrid model with a sliding-window group)."""

from __future__ import annotations

import numpy as np
import torch

from kvforge.executor.input_batch import InputBatch
from kvforge.sampling_params import SamplingParams
from kvforge.step_data import NewRequest, ScheduledRequest, SchedulerOutput

BLOCK_SIZE = 4


class _Plain:
    """What the runner holds per request, as plain lists."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.tables: dict[str, list[list[int]]] = {}

    def step(self, output: SchedulerOutput) -> None:
        for request_id in output.finished_request_ids + output.preempted_request_ids:
            self.tokens.pop(request_id, None)
        for new in output.new_requests:
            self.tokens[new.request_id], self.tables[new.request_id] = list(new.token_ids), [[], [], []]
        for s in output.scheduled:
            del self.tokens[s.request_id][s.num_computed_tokens :]
            self.tokens[s.request_id] += s.token_ids
            for table, ids in zip(self.tables[s.request_id], s.new_block_ids, strict=True):
                table += ids

    def flat(self, scheduled: list[ScheduledRequest]) -> dict[str, list]:
        flat: dict[str, list] = {"input_ids": [], "positions": [], "slots0": [], "slots1": [], "query_start_loc": [0],
                                 "seq_lens": [], "tables0": [], "tables1": [], "state_slot_ids": []}
        for s in scheduled:
            tables = self.tables[s.request_id]
            for position in range(s.num_computed_tokens, s.num_computed_tokens + len(s.token_ids)):
                flat["input_ids"].append(self.tokens[s.request_id][position])
                flat["positions"].append(position)
                for group in (0, 1):
                    block = tables[group][position // BLOCK_SIZE]
                    flat[f"slots{group}"].append(block * BLOCK_SIZE + position % BLOCK_SIZE)
            flat["query_start_loc"].append(flat["query_start_loc"][-1] + len(s.token_ids))
            flat["seq_lens"].append(s.num_computed_tokens + len(s.token_ids))
            flat["state_slot_ids"].append(tables[2][0])
        for group in (0, 1):
            tables = [self.tables[s.request_id][group] for s in scheduled]
            width = max(len(table) for table in tables)
            flat[f"tables{group}"] = [table + [0] * (width - len(table)) for table in tables]
        return flat


def _got(batch: InputBatch, scheduled: list[ScheduledRequest]) -> dict[str, list]:
    rows = np.array([batch.row_of[s.request_id] for s in scheduled])
    step = batch.inputs(rows, np.zeros(len(rows), dtype=np.int64))
    (slots0, tables0), (slots1, tables1) = step.group_tables
    return {"input_ids": step.input_ids.tolist(), "positions": step.positions.tolist(), "slots0": slots0.tolist(),
            "slots1": slots1.tolist(), "query_start_loc": step.query_start_loc.tolist(),
            "seq_lens": step.seq_lens.tolist(), "tables0": tables0.tolist(), "tables1": tables1.tolist(),
            "state_slot_ids": step.state_slot_ids.tolist()}


def _new(request_id: str, token_ids: list[int], num_prompt: int, **params) -> NewRequest:
    return NewRequest(request_id, token_ids, num_prompt, SamplingParams(**params))


def _sched(request_id: str, token_ids: list[int], computed: int, blocks0: list[int], blocks1: list[int],
           slot: list[int] = ()) -> ScheduledRequest:
    return ScheduledRequest(request_id, token_ids, computed, [blocks0, blocks1, list(slot)], 0, True, [])


def _steps() -> list[SchedulerOutput]:
    """Four requests arrive (one a chunked prompt), decode, one is preempted and one finishes (both below the last
    row: condensing moves rows), a new one arrives, and the preempted one comes back whole."""
    return [
        SchedulerOutput(scheduled=[_sched("a", [1, 2, 3, 4, 5], 0, [3, 9], [11, 12], [0]),
                                   _sched("b", [6, 7], 0, [4], [13], [1]),
                                   _sched("c", [8, 9, 10, 11], 0, [5], [14], [2]),
                                   _sched("d", list(range(20, 26)), 0, [6, 7], [15, 16], [3])],
                        new_requests=[_new("a", [1, 2, 3, 4, 5], 5, temperature=0.0),
                                      _new("b", [6, 7], 2, temperature=0.5, top_k=3, seed=7),
                                      _new("c", [8, 9, 10, 11], 4, presence_penalty=0.5, logprobs=2),
                                      _new("d", list(range(20, 30)), 10, top_p=0.9, min_tokens=4)]),
        SchedulerOutput(scheduled=[_sched("d", [26, 27, 28, 29], 6, [8], [17]), _sched("a", [40], 5, [], []),
                                   _sched("c", [41], 4, [2], [21]), _sched("b", [42], 2, [], [])]),
        SchedulerOutput(scheduled=[_sched("c", [43], 5, [], []), _sched("d", [44], 10, [], [18])],
                        preempted_request_ids=["b"], finished_request_ids=["a"]),
        SchedulerOutput(scheduled=[_sched("e", [50, 51, 52], 0, [1], [19], [0]), _sched("d", [45], 11, [], []),
                                   _sched("b", [6, 7, 42], 0, [10], [20], [1]), _sched("c", [46], 6, [], [])],
                        new_requests=[_new("e", [50, 51, 52], 3, repetition_penalty=1.2),
                                      _new("b", [6, 7, 42], 2, temperature=0.5, top_k=3, seed=7)],
                        finished_request_ids=[]),
    ]


def test_each_steps_flat_inputs_equal_the_per_request_construction():
    batch = InputBatch(2, BLOCK_SIZE, torch.device("cpu"), has_states=True, max_num_reqs=2, max_model_len=4)
    plain = _Plain()
    for output in _steps():
        batch.update(output)
        plain.step(output)
        assert _got(batch, output.scheduled) == plain.flat(output.scheduled)
        # rows stay dense: the live requests hold rows 0 .. n-1
        assert sorted(batch.row_of.values()) == list(range(len(plain.tokens)))
        assert set(batch.row_of) == set(plain.tokens)
        for request_id, tokens in plain.tokens.items():
            row = batch.row_of[request_id]
            assert batch.prompt_token_ids(row) + batch.output_token_ids(row) == tokens


def test_sampling_arrays_follow_their_requests_through_condensing():
    batch = InputBatch(2, BLOCK_SIZE, torch.device("cpu"), has_states=True)
    steps = _steps()
    for output in steps[:3]:
        batch.update(output)
    generator_b = batch.generators["b"]
    batch.update(steps[3])
    sampling = batch.sampling_batch(steps[3].scheduled, None)  # e, d, b, c
    assert sampling.temperatures == [1.0, 1.0, 0.5, 1.0] and sampling.top_ks == [-1, -1, 3, -1]
    assert sampling.top_ps == [1.0, 0.9, 1.0, 1.0] and sampling.presence_penalties == [0.0, 0.0, 0.0, 0.5]
    assert sampling.repetition_penalties == [1.2, 1.0, 1.0, 1.0] and sampling.num_logprobs == [None, None, None, 2]
    assert sampling.prompt_token_ids == [[50, 51, 52], list(range(20, 30)), [6, 7], [8, 9, 10, 11]]
    assert sampling.output_token_ids == [[], [44, 45], [42], [41, 43, 46]]
    # the seeded request keeps its generator across its preemption; the others draw from the engine's
    assert sampling.generators == [None, None, generator_b, None]
    assert batch.min_tokens("d") == 4
    e, d, b, c = steps[3].scheduled
    assert batch.sampling_batch([e, d, c], None).presence_penalties == [0.0, 0.0, 0.5]
    row_c = batch.row_of["c"]
    batch.forget(["c"])
    # b takes c's row: the same rows sample next, with b's settings, not c's
    assert batch.row_of["b"] == row_c
    sampling = batch.sampling_batch([e, d, b], None)
    assert sampling.temperatures == [1.0, 1.0, 0.5] and sampling.top_ks == [-1, -1, 3]
    assert sampling.presence_penalties == [0.0, 0.0, 0.0] and sampling.num_logprobs == [None, None, None]
    batch.forget(["b"])
    assert "b" not in batch.generators and "b" not in batch.row_of
