"""ModelRunner._prepare on hand-made batches: the flat inputs and the attention metadata of one step.

Block size 4 throughout; a token at position p of a sequence is written to slot
block_table[p // 4] * 4 + p % 4:

    request     computed  new tokens    block table   positions   slots
    prefill     0         10 11 12      3 5           0 1 2       12 13 14
    decode      5         20            1 2           5           9
    chunk       6         30 31 32      7 4 6         6 7 8       18 19 24
"""

from __future__ import annotations

import torch
from torch import nn

from kvforge.executor.model_runner import ModelRunner
from kvforge.layers.kv_cache_spec import KVCacheSpec
from kvforge.sampling_params import SamplingParams
from kvforge.step_data import NewRequest, ScheduledRequest, SchedulerOutput

BLOCK_SIZE = 4


def _runner() -> ModelRunner:
    spec = KVCacheSpec.key_value(num_layers=1, num_kv_heads=1, head_dim=4)
    return ModelRunner(nn.Module(), 16, BLOCK_SIZE, torch.float32, torch.device("cpu"), spec)


def _scheduled(request_id: str, token_ids: list[int], num_computed: int, block_table: list[int],
               prompt_len: int) -> ScheduledRequest:
    return ScheduledRequest(request_id, token_ids, num_computed, [block_table], prompt_len,
                            needs_sample=num_computed + len(token_ids) >= prompt_len, banned_token_ids=[])


def _first_step(*scheduled: ScheduledRequest) -> SchedulerOutput:
    """A step that meets every request for the first time (its tokens before the chunk are made up)."""
    new = [NewRequest(s.request_id, list(range(s.num_computed_tokens)), s.num_prompt_tokens, SamplingParams())
           for s in scheduled]
    return SchedulerOutput(scheduled=list(scheduled), new_requests=new)


def _prepare(*scheduled: ScheduledRequest) -> dict[str, list]:
    runner = _runner()
    output = _first_step(*scheduled)
    runner.requests.update(output)
    batch = runner._prepare(output)
    metadata = batch.metadata
    return {
        "input_ids": batch.input_ids.tolist(),
        "positions": batch.positions.tolist(),
        "slot_mapping": metadata.slot_mapping.tolist(),
        "query_start_loc": metadata.query_start_loc.tolist(),
        "seq_lens": metadata.seq_lens.tolist(),
        "block_tables": metadata.block_tables.tolist(),
    }


def test_prefill_decode_and_prefill_chunk_in_one_flat_batch():
    got = _prepare(
        _scheduled("prefill", [10, 11, 12], 0, [3, 5], prompt_len=3),
        _scheduled("decode", [20], 5, [1, 2], prompt_len=4),
        _scheduled("chunk", [30, 31, 32], 6, [7, 4, 6], prompt_len=12),
    )
    assert got == {
        "input_ids": [10, 11, 12, 20, 30, 31, 32],
        "positions": [0, 1, 2, 5, 6, 7, 8],
        "slot_mapping": [12, 13, 14, 9, 18, 19, 24],
        "query_start_loc": [0, 3, 4, 7],
        "seq_lens": [3, 6, 9],
        "block_tables": [[3, 5, 0], [1, 2, 0], [7, 4, 6]],  # padded with the null block
    }


def test_decodes_only_one_row_per_sequence():
    got = _prepare(
        _scheduled("a", [7], 0, [2], prompt_len=1),
        _scheduled("b", [8], 3, [6], prompt_len=2),
        _scheduled("c", [9], 4, [1, 5], prompt_len=2),  # the first token of its second block
    )
    assert got["positions"] == [0, 3, 4] and got["slot_mapping"] == [8, 27, 20]
    assert got["query_start_loc"] == [0, 1, 2, 3] and got["seq_lens"] == [1, 4, 5]
    assert got["block_tables"] == [[2, 0], [6, 0], [1, 5]]


def test_after_a_prefix_cache_hit_positions_start_past_the_cached_blocks():
    """8 tokens found in the prefix cache (blocks 9 and 8): the step computes the last 2 prompt tokens."""
    got = _prepare(_scheduled("hit", [40, 41], 8, [9, 8, 3], prompt_len=10))
    assert got["positions"] == [8, 9] and got["slot_mapping"] == [12, 13]
    assert got["seq_lens"] == [10] and got["block_tables"] == [[9, 8, 3]]


def test_slot_indices_past_two_to_the_31_do_not_overflow():
    """A block id near the top of a large cache: slot_mapping is int64."""
    big_block = 2**29 + 3  # * 4 slots per block > 2**31
    got = _prepare(_scheduled("big", [1, 2], 0, [big_block], prompt_len=2))
    assert got["slot_mapping"] == [big_block * 4, big_block * 4 + 1]


def test_later_steps_carry_only_new_tokens_and_blocks():
    """The runner keeps each request's tokens and block table: a decode sends one token and the
    blocks its table gained; a preempted request comes back whole and its old state is gone."""
    runner = _runner()
    runner.requests.update(_first_step(_scheduled("a", [10, 11, 12, 13], 0, [3], prompt_len=4)))
    step = SchedulerOutput(scheduled=[_scheduled("a", [50], 4, [6], prompt_len=4)])
    runner.requests.update(step)
    batch = runner._prepare(step)
    requests, row = runner.requests, runner.requests.row_of["a"]
    assert requests.prompt_token_ids(row) == [10, 11, 12, 13] and requests.output_token_ids(row) == [50]
    assert batch.metadata.block_tables.tolist() == [[3, 6]] and batch.metadata.slot_mapping.tolist() == [24]
    assert batch.metadata.slot_mapping.dtype == torch.int64
    resumed = SchedulerOutput(scheduled=[_scheduled("a", [10, 11, 12, 13, 50], 0, [2, 5], prompt_len=4)],
                              new_requests=[NewRequest("a", [10, 11, 12, 13, 50], 4, SamplingParams())],
                              preempted_request_ids=["a"])
    requests.update(resumed)
    row = requests.row_of["a"]
    assert requests.block_tables[0, row, : requests.num_blocks[0, row]].tolist() == [2, 5]
    assert requests.output_token_ids(row) == [50]
