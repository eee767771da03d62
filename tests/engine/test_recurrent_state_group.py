"""The recurrent-state group of the KV cache manager stepped by hand (a hybrid model: full attention and linear
attention): one state slot per running request, taken when it is first scheduled, sent to the runner once, given back
when it finishes, is aborted or is preempted (and taken again to recompute); prefix hits only where a checkpointed
state exists (engine/state_checkpoints.py); nothing leaks."""

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


def _scheduler(num_blocks: int = 64, budget: int = 64, prefix: bool = True, checkpoints: int = 0) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, prefix, HYBRID, num_state_checkpoints=checkpoints)
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


def _run(scheduler: Scheduler) -> list[SchedulerOutput]:
    """Every step until no request is left."""
    outputs = []
    while scheduler.num_unfinished:
        outputs.append(scheduler.schedule())
        _update(scheduler, outputs[-1])
    return outputs


def test_no_prefix_hits_without_state_checkpoints():
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


def test_a_prompt_keeps_its_state_at_its_last_block_boundary_and_a_repeat_hits_it():
    """A 13-token prompt (blocks of 4) runs in chunks of 12 and 1: after the first, its slot is copied into checkpoint
    0; the same prompt later takes 12 tokens from the cache, its slot loaded from that checkpoint; nothing leaks."""
    scheduler = _scheduler(checkpoints=2)
    prompt = list(range(13))
    _add(scheduler, "a", prompt, max_tokens=2)
    first, *rest = _run(scheduler)
    (a,) = first.scheduled
    assert (len(a.token_ids), a.load_state_from, a.save_state_to) == (12, None, 0)
    assert [len(s.token_ids) for o in rest for s in o.scheduled] == [1, 1]  # the last prompt token, then a decode
    assert all(s.save_state_to is None for o in rest for s in o.scheduled)
    request = _add(scheduler, "b", prompt, max_tokens=1)
    output = scheduler.schedule()
    (b,) = output.scheduled
    assert (b.num_computed_tokens, len(b.token_ids), b.load_state_from, b.save_state_to) == (12, 1, 0, None)
    assert request.num_cached_tokens == 12 and scheduler.kv.stats().num_prefix_hit_tokens == 12
    _update(scheduler, output)
    assert _slots(scheduler) == {} and scheduler.kv.num_free_blocks == 63


def test_a_checkpoint_serves_hits_only_after_the_step_that_saves_it():
    """Two prompts sharing 8 tokens in one step: the second cannot load a state the first has not computed yet."""
    scheduler = _scheduler(checkpoints=2)
    _add(scheduler, "a", list(range(9)), max_tokens=1)
    _add(scheduler, "b", list(range(9)), max_tokens=1)
    output = scheduler.schedule()
    assert [(s.num_computed_tokens, s.load_state_from) for s in output.scheduled] == [(0, None), (0, None)]
    # NOTE: the KV blocks of a's first 8 tokens are cached already: b stops there too, its save a repeat of a's
    assert [(len(s.token_ids), s.save_state_to) for s in output.scheduled] == [(8, 0), (8, None)]


def test_the_first_request_sharing_a_cached_prefix_keeps_the_state_there_for_the_next():
    """a and b share 8 tokens (two blocks), then differ: b finds a's KV blocks but no state after them, so its chunk
    stops at 8 and keeps it; c, sharing the same 8 tokens, then hits them."""
    scheduler = _scheduler(checkpoints=2)
    shared = list(range(8))
    _add(scheduler, "a", shared + [20, 21, 22, 23, 24], max_tokens=1)
    _run(scheduler)  # a keeps the state after 12 tokens
    _add(scheduler, "b", shared + [30, 31, 32, 33, 34], max_tokens=1)
    output = scheduler.schedule()
    (b,) = output.scheduled
    assert (b.num_computed_tokens, len(b.token_ids), b.save_state_to) == (0, 8, 1)
    _update(scheduler, output)
    _run(scheduler)
    request = _add(scheduler, "c", shared + [40, 41], max_tokens=1)
    (c,) = scheduler.schedule().scheduled
    assert (c.num_computed_tokens, c.load_state_from) == (8, 1) and request.num_cached_tokens == 8


def test_the_least_recently_used_checkpoint_is_reused():
    """One checkpoint: the second prompt's state takes it, and the first prompt is no longer a hit."""
    scheduler = _scheduler(checkpoints=1)
    for request_id, prompt in (("a", list(range(5))), ("b", list(range(50, 55)))):
        _add(scheduler, request_id, prompt, max_tokens=1)
        outputs = _run(scheduler)
        assert outputs[0].scheduled[0].save_state_to == 0
    _add(scheduler, "again", list(range(5)), max_tokens=1)
    assert scheduler.schedule().scheduled[0].num_computed_tokens == 0
