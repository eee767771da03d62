"""The scheduler stepped by hand: token budget, chunked prefill, preemption, aborts, no leaks."""

from __future__ import annotations

from kvforge.config import SchedulerConfig
from kvforge.engine.kv_cache_manager import KVCacheManager
from kvforge.engine.request import Request, RequestStatus
from kvforge.engine.scheduler import Scheduler
from kvforge.sampling_params import SamplingParams
from kvforge.step_data import ModelRunnerOutput, SchedulerOutput


def _make(num_blocks=64, block_size=4, budget=16, max_seqs=8, prefix=True) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, prefix)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs), kv)


def _add(scheduler: Scheduler, request_id: str, prompt_len: int, max_tokens: int = 4, base: int = 0) -> Request:
    request = Request(request_id, [base + i for i in range(prompt_len)], SamplingParams(max_tokens=max_tokens))
    scheduler.add_request(request)
    return request


def _sampled(output: SchedulerOutput, *token_ids: int) -> ModelRunnerOutput:
    """What a fake model returns: the same tokens for every request that samples in the step."""
    return ModelRunnerOutput({s.request_id: list(token_ids) for s in output.scheduled if s.needs_sample})


def _step(scheduler: Scheduler, token: int = 7) -> dict[str, int]:
    """One step with a fake model that always samples `token`; returns tokens scheduled per request."""
    output = scheduler.schedule()
    scheduler.update_from_output(output, _sampled(output, token))
    return {s.request_id: len(s.token_ids) for s in output.scheduled}


def test_decodes_and_prefill_chunks_share_one_budget():
    scheduler = _make(budget=16)
    _add(scheduler, "a", 6)
    assert _step(scheduler) == {"a": 6}
    _add(scheduler, "b", 40, base=100)
    assert _step(scheduler) == {"a": 1, "b": 15}  # the decode first, the prefill fills the rest
    assert _step(scheduler) == {"a": 1, "b": 15}
    assert _step(scheduler) == {"a": 1, "b": 10}
    assert _step(scheduler) == {"b": 1}  # a finished after 4 tokens


def test_max_num_seqs_bounds_the_batch():
    scheduler = _make(max_seqs=2)
    for name in "abc":
        _add(scheduler, name, 3)
    assert set(_step(scheduler)) == {"a", "b"}


def test_newest_request_preempted_and_recomputed_when_blocks_run_out():
    scheduler = _make(num_blocks=5, block_size=4, budget=64, prefix=False)  # 4 usable blocks
    a = _add(scheduler, "a", 7, max_tokens=6)
    b = _add(scheduler, "b", 7, max_tokens=6, base=100)
    assert _step(scheduler) == {"a": 7, "b": 7}
    assert _step(scheduler) == {"a": 1, "b": 1}  # both now hold 8 tokens in 2 blocks each
    steps = [_step(scheduler)]  # a needs a third block: b is preempted
    assert steps[0] == {"a": 1} and b.status == RequestStatus.PREEMPTED and scheduler.num_preemptions == 1
    while scheduler.num_unfinished:
        steps.append(_step(scheduler))
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6
    assert any(s.get("b", 0) > 1 for s in steps[1:])  # b recomputed its prompt and outputs in one go
    assert scheduler.kv.num_free_blocks == 4


def test_abort_frees_blocks_at_once_and_prefix_hits_are_counted():
    scheduler = _make(block_size=4)
    _add(scheduler, "a", 12, max_tokens=50)
    _step(scheduler)
    _add(scheduler, "b", 12, max_tokens=50)  # same prompt: 2 of its 3 blocks hit (last token recomputed)
    assert _step(scheduler) == {"a": 1, "b": 4}
    assert scheduler.requests["b"].num_cached_tokens == 8
    scheduler.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv.num_free_blocks == 63 and not scheduler.running
    assert scheduler.schedule().finished_request_ids == ["a", "b"]


def test_micro_batches_split_the_requests_and_skip_those_in_flight():
    """Pipeline parallelism: two steps in flight take disjoint halves; a busy request is not preempted."""
    scheduler = _make(num_blocks=64, budget=64)
    for i in range(4):
        _add(scheduler, f"r{i}", 4, base=10 * i)
    first = scheduler.schedule(num_micro_batches=2)
    busy = {s.request_id for s in first.scheduled}
    second = scheduler.schedule(busy, num_micro_batches=2)
    assert busy == {"r0", "r1"} and {s.request_id for s in second.scheduled} == {"r2", "r3"}
    assert not scheduler.schedule(busy | {"r2", "r3"}, num_micro_batches=2).scheduled


def test_requests_in_flight_are_never_preempted():
    scheduler = _make(num_blocks=3, block_size=4, budget=64)  # 2 usable blocks of 4 tokens
    _add(scheduler, "old", 4)
    _add(scheduler, "new", 4, base=50)
    first = scheduler.schedule()
    scheduler.update_from_output(first, _sampled(first, 7))
    # "old" needs a second block for its next token; the newest, "new", is in flight, so "old" yields
    out = scheduler.schedule({"new"})
    assert out.preempted_request_ids == ["old"] and not out.scheduled
    assert scheduler.requests["new"].status == RequestStatus.RUNNING


def test_update_appends_tokens_up_to_a_stop_token_and_frees_the_finished():
    """k tokens for one request in one step (as when speculating): those after a stop token are dropped."""
    scheduler = _make(block_size=4)
    a = _add(scheduler, "a", 5, max_tokens=10)
    a.sampling_params.stop_token_ids.append(9)
    b = _add(scheduler, "b", 5, max_tokens=10, base=50)
    output = scheduler.schedule()
    result = scheduler.update_from_output(output, ModelRunnerOutput({"a": [3, 9, 4], "b": [3, 4]}))
    assert result.new_token_ids == {"a": [3, 9], "b": [3, 4]}
    assert [r.request_id for r in result.finished] == ["a"] and [r.request_id for r in result.advanced] == ["a", "b"]
    assert a.output_token_ids == [3, 9] and a.finish_reason == "stop" and a.stop_reason == 9
    assert b.output_token_ids == [3, 4] and b.num_computed_tokens == 5 and b.status == RequestStatus.RUNNING
    assert scheduler.kv.num_free_blocks == 63 - 2  # a's two blocks are back; b holds two
    assert scheduler.schedule().finished_request_ids == ["a"]


def test_update_finishes_at_max_tokens_and_skips_requests_aborted_in_flight():
    scheduler = _make()
    a = _add(scheduler, "a", 3, max_tokens=2)
    _add(scheduler, "b", 3, base=50)
    output = scheduler.schedule()
    scheduler.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)  # while the step ran
    result = scheduler.update_from_output(output, ModelRunnerOutput({"a": [5, 6, 7], "b": [5]}))
    assert result.new_token_ids == {"a": [5, 6]} and a.finish_reason == "length"
    assert not scheduler.num_unfinished and scheduler.kv.num_free_blocks == 63


def test_a_request_travels_whole_once_then_only_its_new_tokens_and_blocks():
    """Block size 4, prompt of 6: the first step sends the prompt and both blocks; decodes send one token
    and a block only when the table grows; after a preemption the request is sent whole again."""
    scheduler = _make(num_blocks=5, block_size=4, budget=64, prefix=False)
    _add(scheduler, "a", 6, max_tokens=8)
    first = scheduler.schedule()
    assert [(n.request_id, n.token_ids) for n in first.new_requests] == [("a", [0, 1, 2, 3, 4, 5])]
    assert first.scheduled[0].new_block_ids == [[1, 2]]
    sent = []
    scheduler.update_from_output(first, _sampled(first, 7))
    for _ in range(3):
        output = scheduler.schedule()
        sent.append((len(output.new_requests), output.scheduled[0].token_ids, output.scheduled[0].new_block_ids))
        scheduler.update_from_output(output, _sampled(output, 7))
    assert sent == [(0, [7], [[]]), (0, [7], [[]]), (0, [7], [[3]])]  # computing the 9th token opens a third block
    _add(scheduler, "b", 4, max_tokens=8, base=50)  # takes the last free block
    scheduler.update_from_output(step := scheduler.schedule(), _sampled(step, 7))
    step = scheduler.schedule()  # b's 5th token needs a block: b, the newest, is preempted
    assert step.preempted_request_ids == ["b"] and [s.request_id for s in step.scheduled] == ["a"]
    scheduler.update_from_output(step, _sampled(step, 7))
    while not (resumed := scheduler.schedule()).new_requests:
        scheduler.update_from_output(resumed, _sampled(resumed, 7))
    assert [(n.request_id, n.token_ids) for n in resumed.new_requests] == [("b", [50, 51, 52, 53, 7])]
    resent = [s.new_block_ids for s in resumed.scheduled if s.request_id == "b"]
    assert resent == [scheduler.kv.get_block_tables("b")] and len(resent[0][0]) == 2  # its whole new table
