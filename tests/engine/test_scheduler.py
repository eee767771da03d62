"""The scheduler stepped by hand: token budget, chunked prefill, preemption, aborts, no leaks."""

from __future__ import annotations

from kvforge.config import SchedulerConfig
from kvforge.engine.kv_cache_manager import KVCacheManager
from kvforge.engine.request import Request, RequestStatus
from kvforge.engine.scheduler import Scheduler
from kvforge.sampling_params import SamplingParams


def _make(num_blocks=64, block_size=4, budget=16, max_seqs=8, prefix=True) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, prefix)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs), kv)


def _add(scheduler: Scheduler, request_id: str, prompt_len: int, max_tokens: int = 4, base: int = 0) -> Request:
    request = Request(request_id, [base + i for i in range(prompt_len)], SamplingParams(max_tokens=max_tokens))
    scheduler.add_request(request)
    return request


def _step(scheduler: Scheduler, token: int = 7) -> dict[str, int]:
    """One step with a fake model that always samples `token`; returns tokens scheduled per request."""
    output = scheduler.schedule()
    scheduler.update_after_step(output)
    finished = []
    for scheduled in output.scheduled:
        request = scheduler.requests[scheduled.request_id]
        if scheduled.needs_sample:
            request.append_output_token(token)
            if request.check_stop_token() is not None:
                finished.append(request.request_id)
    scheduler.finish_requests(finished, RequestStatus.FINISHED_LENGTH)
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
    scheduler.update_after_step(first)
    for request in scheduler.running:
        request.append_output_token(7)
    # "old" needs a second block for its next token; the newest, "new", is in flight, so "old" yields
    out = scheduler.schedule({"new"})
    assert out.preempted_request_ids == ["old"] and not out.scheduled
    assert scheduler.requests["new"].status == RequestStatus.RUNNING
