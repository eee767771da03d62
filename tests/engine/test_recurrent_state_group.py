"""The recurrent-state group of the KV cache manager stepped by hand (a hybrid model: full attention and linear
attention): one state slot per running request, taken when it is first scheduled, sent to the runner once, given back
when it finishes, is aborted or is preempted (and taken again to recompute); no prefix hits; nothing leaks."""

from __future__ import annotations

import torch

from kvforge.config import SchedulerConfig
from kvforge.engine.kv_cache_manager import KVCacheManager
from kvforge.engine.request import Request, RequestStatus
from kvforge.engine.scheduler import Scheduler
from kvforge.layers.kv_cache_spec import KVCacheSpec, LayerGroup
from kvforge.layers.recurrent_state_spec import RecurrentStateSpec
from kvforge.sampling_params import SamplingParams
from kvforge.step_data import ModelRunnerOutput, SchedulerOutput

HYBRID = (LayerGroup("full_attention", (0,)), LayerGroup("recurrent_state", (1, 2, 3)))


def _scheduler(num_blocks: int = 64, budget: int = 64, prefix: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, prefix, HYBRID)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16), kv)


def _add(scheduler: Scheduler, request_id: str, prompt: list[int], max_tokens: int) -> Request:
    request = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    scheduler.add_request(request)
    return request


def _update(scheduler: Scheduler, output: SchedulerOutput) -> None:
    sampled = {s.request_id: [7] for s in output.scheduled if s.needs_sample}
    scheduler.update_from_output(output, ModelRunnerOutput(sampled))


def _slots(scheduler: Scheduler) -> dict[str, int]:
    return dict(scheduler.kv.groups[-1].slots)


def test_a_hybrid_spec_has_a_recurrent_state_group_after_its_paged_layers():
    states = RecurrentStateSpec.gated_delta_net(3, conv_channels=40, conv_width=4, num_heads=2, key_head_dim=8,
                                                value_head_dim=4)
    spec = KVCacheSpec(((((2, 16), (2, 16)),)), recurrent_state=states)
    assert spec.cache_groups() == HYBRID
    # per layer: the conv state (40 channels x 3 inputs, float16) and the delta state (2 x 8 x 4, float32)
    assert states.bytes_per_slot(torch.float16) == 3 * (40 * 3 * 2 + 2 * 8 * 4 * 4)


def test_a_slot_per_request_sent_once_and_kept_across_prefill_chunks():
    scheduler = _scheduler(budget=6)  # a 10-token prompt in chunks of 6 and 4
    _add(scheduler, "a", list(range(10)), max_tokens=3)
    _add(scheduler, "b", list(range(20, 23)), max_tokens=3)
    first = scheduler.schedule()
    assert [s.request_id for s in first.scheduled] == ["a"]
    assert first.scheduled[0].new_block_ids[1] == [0] and _slots(scheduler) == {"a": 0}
    _update(scheduler, first)
    second = scheduler.schedule()  # a's second chunk (4 tokens), then b's prompt (2 of 3 tokens)
    assert [(s.request_id, len(s.token_ids)) for s in second.scheduled] == [("a", 4), ("b", 2)]
    assert [s.new_block_ids[1] for s in second.scheduled] == [[], [1]]  # a's slot went with its first chunk
    _update(scheduler, second)
    assert _slots(scheduler) == {"a": 0, "b": 1}


def test_slots_are_given_back_on_finish_and_abort_and_reused():
    scheduler = _scheduler()
    _add(scheduler, "a", [1, 2, 3], max_tokens=1)
    _add(scheduler, "b", [4, 5, 6], max_tokens=5)
    _add(scheduler, "c", [7, 8, 9], max_tokens=5)
    _update(scheduler, scheduler.schedule())  # a finishes at its first token
    assert _slots(scheduler) == {"b": 1, "c": 2}
    scheduler.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    assert _slots(scheduler) == {"b": 1}
    _add(scheduler, "d", [10, 11], max_tokens=2)
    output = scheduler.schedule()
    assert [s.new_block_ids[1] for s in output.scheduled if s.request_id == "d"] == [[0]]  # the smallest free slot
    while scheduler.num_unfinished:
        _update(scheduler, output)
        output = scheduler.schedule()
    assert _slots(scheduler) == {} and scheduler.kv.num_free_blocks == 63


def test_a_preempted_request_gives_its_slot_back_and_takes_one_again_to_recompute():
    scheduler = _scheduler(num_blocks=5)  # 4 usable blocks of 4 tokens
    _add(scheduler, "a", list(range(7)), max_tokens=6)
    _add(scheduler, "b", list(range(10, 17)), max_tokens=6)
    _update(scheduler, scheduler.schedule())  # both prompts: 2 blocks each
    assert _slots(scheduler) == {"a": 0, "b": 1}
    _update(scheduler, scheduler.schedule())  # the 8th tokens still fit
    output = scheduler.schedule()  # a's 9th token needs a third block: b, the newest, is preempted
    assert output.preempted_request_ids == ["b"] and _slots(scheduler) == {"a": 0}
    while "b" not in [s.request_id for s in output.scheduled]:
        _update(scheduler, output)
        output = scheduler.schedule()
    rerun = next(s for s in output.scheduled if s.request_id == "b")
    assert rerun.num_computed_tokens == 0 and rerun.new_block_ids[1] == [_slots(scheduler)["b"]]
    while scheduler.num_unfinished:
        _update(scheduler, output)
        output = scheduler.schedule()
    assert _slots(scheduler) == {} and scheduler.kv.num_free_blocks == 4


def test_no_prefix_hits_for_a_hybrid_model():
    """No slot keeps the state after a cached prefix: the same prompt again is recomputed whole."""
    scheduler = _scheduler()
    prompt = list(range(13))
    _add(scheduler, "a", prompt, max_tokens=1)
    _update(scheduler, scheduler.schedule())
    request = _add(scheduler, "b", prompt, max_tokens=1)
    output = scheduler.schedule()
    assert output.scheduled[0].num_computed_tokens == 0 and len(output.scheduled[0].token_ids) == 13
    _update(scheduler, output)
    assert request.num_cached_tokens == 0 and _slots(scheduler) == {}
