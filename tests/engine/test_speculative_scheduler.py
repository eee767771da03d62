"""The scheduler with draft tokens, stepped by hand: drafts count in the token budget, accepted drafts
advance the request, rejected drafts give their slots back, prefix-cache hashes never cover drafts."""

from __future__ import annotations

from kvforge.config import SchedulerConfig
from kvforge.engine.kv_cache_manager import KVCacheManager
from kvforge.engine.request import Request, RequestStatus
from kvforge.engine.scheduler import Scheduler
from kvforge.engine.speculation import Speculation
from kvforge.sampling_params import SamplingParams
from kvforge.spec_decode.policy import SpeculationPolicy, StepCosts
from kvforge.step_data import ModelRunnerOutput

DRAFTS = [100, 101, 102, 103, 104, 105]  # what the runner proposes after every sampled token


def _make(num_blocks=64, block_size=4, budget=16, k=4, max_rows=16) -> Scheduler:
    """Every decoding request drafts up to k (the policy not adaptive), within max_rows rows per step."""
    kv = KVCacheManager(num_blocks, block_size, True)
    speculation = Speculation(SpeculationPolicy(k, max_rows, StepCosts(), adaptive=False))
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget), kv, speculation)


def _add(scheduler, request_id, prompt, max_tokens=20, **params) -> Request:
    request = Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, **params),
                      eos_token_ids=frozenset({2}))
    scheduler.add_request(request)
    return request


def _step(scheduler, returned: dict[str, list[int]]):
    output = scheduler.schedule()
    sampling = [s.request_id for s in output.scheduled if s.needs_sample]
    runner = ModelRunnerOutput({request_id: returned[request_id] for request_id in sampling},
                               draft_token_ids=dict.fromkeys(sampling, DRAFTS))
    return output, scheduler.update_from_output(output, runner)


def test_drafts_share_the_budget_and_accepted_ones_advance_the_request():
    scheduler = _make(budget=16)
    a = _add(scheduler, "a", range(10, 16))
    output, _ = _step(scheduler, {"a": [7]})  # prefill: no drafts, but the runner proposes some for the next step
    assert output.scheduled[0].num_draft_tokens == 0 and output.scheduled[0].propose_drafts
    _add(scheduler, "b", range(40, 80))
    output, result = _step(scheduler, {"a": [100, 101, 9], "b": []})  # a accepts 2 of 4 drafts
    assert [(s.request_id, len(s.token_ids), s.num_draft_tokens) for s in output.scheduled] == [
        ("a", 5, 4), ("b", 11)[:2] + (0,)]
    assert output.scheduled[0].token_ids == [7, 100, 101, 102, 103]
    assert result.new_token_ids["a"] == [100, 101, 9]
    assert a.output_token_ids == [7, 100, 101, 9] and a.num_computed_tokens == a.num_tokens - 1
    stats = scheduler.stats().spec_decode
    assert stats.num_drafted_per_position == (1, 1, 1, 1) and stats.num_accepted_per_position == (1, 1, 0, 0)
    assert stats.mean_accepted_length == 3.0
    # the next step writes over the rejected drafts' slots: from position 9 on
    output, _ = _step(scheduler, {"a": [5], "b": [6]})
    assert output.scheduled[0].num_computed_tokens == 9 and output.scheduled[0].token_ids[0] == 9


def test_drafts_never_let_a_request_pass_max_tokens_or_the_budget():
    scheduler = _make(budget=3, k=4)
    a = _add(scheduler, "a", [5, 6], max_tokens=5)
    _step(scheduler, {"a": [7]})
    output, _ = _step(scheduler, {"a": [100, 101, 9]})  # the budget leaves room for 2 drafts
    assert output.scheduled[0].num_draft_tokens == 2
    output, result = _step(scheduler, {"a": [11]})  # one token left before max_tokens: no drafts
    assert output.scheduled[0].num_draft_tokens == 0
    assert a.status == RequestStatus.FINISHED_LENGTH and a.num_output_tokens == 5


def test_a_stop_token_among_accepted_drafts_ends_the_request_there():
    scheduler = _make()
    a = _add(scheduler, "a", [5, 6, 8])
    _step(scheduler, {"a": [7]})
    _, result = _step(scheduler, {"a": [100, 2, 103]})  # (the runner never returns past a stop, but:)
    assert result.new_token_ids["a"] == [100, 2] and a.status == RequestStatus.FINISHED_STOPPED
    assert scheduler.kv.num_free_blocks == 63 and not scheduler.speculation.proposed


def test_prefix_cache_hashes_cover_accepted_tokens_only():
    scheduler = _make(block_size=4)
    _add(scheduler, "a", [5, 6, 8])
    _step(scheduler, {"a": [7]})
    _step(scheduler, {"a": [9]})  # drafts 100..103 at positions 4..7 all rejected
    # a prompt that repeats a's tokens and the rejected drafts finds only a's first block cached
    b = Request("b", [5, 6, 8, 7, 100, 101, 102, 103, 1], SamplingParams())
    assert scheduler.kv.find_cached_prefix(b).num_blocks == 1
    c = Request("c", [5, 6, 8, 7, 9, 1, 1, 1, 1], SamplingParams())
    _step(scheduler, {"a": [100, 101, 102, 103, 3]})  # all 4 drafts accepted: block 1 = 9, 100, 101, 102
    d = Request("d", [5, 6, 8, 7, 9, 100, 101, 102, 1], SamplingParams())
    assert scheduler.kv.find_cached_prefix(c).num_blocks == 1 and scheduler.kv.find_cached_prefix(d).num_blocks == 2


def test_rows_past_max_rows_go_without_drafts_and_nothing_leaks():
    scheduler = _make(budget=64, max_rows=3)
    for name in "abc":
        _add(scheduler, name, [5, 6, 8], max_tokens=4)
    _step(scheduler, dict.fromkeys("abc", [7]))
    output, _ = _step(scheduler, dict.fromkeys("abc", [9]))
    assert all(s.num_draft_tokens == 0 for s in output.scheduled)  # 3 decoding requests fill the 3 rows
    assert not any(s.propose_drafts for s in output.scheduled)  # and the runner need not propose for them
    scheduler.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    output, _ = _step(scheduler, {"a": [100, 3], "b": [4]})
    assert [s.num_draft_tokens for s in output.scheduled] == [1, 0]  # one row left: the first request's
    _step(scheduler, {"b": [5]})  # a finished on max_tokens with its accepted draft
    assert not scheduler.num_unfinished and scheduler.kv.num_free_blocks == 63
