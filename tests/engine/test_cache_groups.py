"""The KV cache manager of layer groups stepped by hand: sliding-window blocks go back to the pool exactly when the
request has moved past them, prefix hits only where a window's blocks are still cached, nothing leaks."""

from __future__ import annotations

import torch

from kvforge.config import SchedulerConfig
from kvforge.engine.block_pool import NULL_BLOCK_ID
from kvforge.engine.kv_cache_manager import KVCacheManager
from kvforge.engine.request import Request
from kvforge.engine.scheduler import Scheduler
from kvforge.layers.kv_cache_spec import KVCacheSpec, LayerGroup
from kvforge.sampling_params import SamplingParams
from kvforge.step_data import ModelRunnerOutput

FULL_AND_WINDOW = (LayerGroup("full_attention", (1,)), LayerGroup("sliding_window", (0,), sliding_window=6))


def _scheduler(num_blocks=64, block_size=4, budget=64, groups=FULL_AND_WINDOW, prefix=True) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, prefix, groups)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16), kv)


def _step(scheduler: Scheduler, token: int = 7) -> dict[str, int]:
    output = scheduler.schedule()
    sampled = {s.request_id: [token] for s in output.scheduled if s.needs_sample}
    scheduler.update_from_output(output, ModelRunnerOutput(sampled))
    return {s.request_id: len(s.token_ids) for s in output.scheduled}


def _add(scheduler: Scheduler, request_id: str, prompt: list[int], max_tokens: int) -> Request:
    request = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    scheduler.add_request(request)
    return request


def test_window_blocks_return_to_the_pool_once_the_next_query_no_longer_reads_them():
    scheduler = _scheduler(num_blocks=64, block_size=4, budget=5)  # a 13-token prompt in chunks of 5
    request = _add(scheduler, "a", list(range(13)), max_tokens=12)
    full, window = scheduler.kv.groups
    while not request.status.finished:
        first = request.num_computed_tokens
        output = scheduler.schedule()
        last = first + len(output.scheduled[0].token_ids) - 1
        # the step's queries are positions first..last; a window of 6 reads keys from first - 5 on
        held = [i for i, b in enumerate(window.table("a")) if b != NULL_BLOCK_ID]
        assert held == list(range(max(0, first - 5) // 4, last // 4 + 1)), (first, last)
        assert full.table("a") == [b for b in full.table("a") if b != NULL_BLOCK_ID]
        assert len(full.table("a")) == last // 4 + 1
        assert scheduler.kv.num_free_blocks == 63 - len(full.table("a")) - len(held)
        scheduler.update_from_output(output, ModelRunnerOutput({"a": [7]} if output.scheduled[0].needs_sample else {}))
    assert request.num_output_tokens == 12 and scheduler.kv.num_free_blocks == 63


def test_released_blocks_match_the_window_exactly():
    kv = KVCacheManager(64, 4, False, FULL_AND_WINDOW)
    request = Request("a", list(range(30)), SamplingParams(max_tokens=1))
    assert kv.allocate_slots(request, 13)  # tokens 0..12 in blocks 0..3
    window = kv.groups[1]
    assert NULL_BLOCK_ID not in window.table("a") and kv.num_free_blocks == 63 - 8
    for num_computed, num_released in [(13, 2), (14, 2), (15, 2), (16, 2), (17, 3), (21, 4), (25, 5)]:
        request.num_computed_tokens = num_computed
        assert kv.allocate_slots(request, 1)
        # the next query at num_computed reads from num_computed - 5: blocks ending at or before it are free
        assert window.table("a")[:num_released] == [NULL_BLOCK_ID] * num_released, num_computed
        assert NULL_BLOCK_ID not in window.table("a")[num_released:]
        assert kv.num_free_blocks == 63 - len(kv.groups[0].table("a")) - (len(window.table("a")) - num_released)
    kv.free(request)
    assert kv.num_free_blocks == 63


def test_prefix_hit_needs_the_window_blocks_and_not_the_ones_before():
    scheduler = _scheduler(num_blocks=64, block_size=4)
    prompt = list(range(100, 121))  # 21 tokens: 5 full blocks
    a = _add(scheduler, "a", prompt, max_tokens=1)
    _step(scheduler)
    assert a.status.finished and scheduler.kv.num_free_blocks == 63
    # a's window blocks went back to the pool still cached: a request with the same prompt hits them all
    b = _add(scheduler, "b", prompt + [1, 2, 3], max_tokens=1)
    hit = scheduler.kv.find_cached_prefix(b)
    assert hit.num_blocks == 5
    # the window group shares only the blocks the query at position 20 reads (keys 15..20: blocks 3, 4)
    assert hit.block_ids[1][:3] == [NULL_BLOCK_ID] * 3 and NULL_BLOCK_ID not in hit.block_ids[1][3:]
    assert NULL_BLOCK_ID not in hit.block_ids[0]
    _step(scheduler)
    assert b.num_cached_tokens == 20 and b.status.finished and scheduler.kv.num_free_blocks == 63


def test_a_hit_needs_its_window_cached_so_a_longer_prefix_may_hit_where_a_shorter_does_not():
    kv = KVCacheManager(16, 4, True, FULL_AND_WINDOW)  # 15 usable blocks
    prompt = list(range(21))
    a = Request("a", prompt, SamplingParams(max_tokens=1))
    for num_computed, num_new in [(0, 8), (8, 8), (16, 5)]:  # chunked prefill
        a.num_computed_tokens = num_computed
        assert kv.allocate_slots(a, num_new)
    window_blocks = kv.groups[1].table("a")
    assert window_blocks[:2] == [NULL_BLOCK_ID] * 2  # the query at 16 reads keys from 11: blocks 0, 1 released
    assert kv.num_free_blocks == 15 - 6 - 4
    filler = Request("f", [99] * 5, SamplingParams(max_tokens=1))
    assert kv.allocate_slots(filler, 5)  # takes the 3 unused blocks, then a's released window block 0
    # 8 tokens: the query at 8 reads keys 3..8, in window block 0 (evicted): no hit, nor for 4 tokens
    assert kv.find_cached_prefix(Request("b", prompt[:8] + [0], SamplingParams())).num_blocks == 0
    # 12 tokens: the query at 12 reads keys 7..12, blocks 1 and 2 (cached): a hit of 3 blocks
    hit = kv.find_cached_prefix(Request("c", prompt[:12] + [0], SamplingParams()))
    assert hit.num_blocks == 3 and hit.block_ids[0] == kv.groups[0].table("a")[:3]
    assert hit.block_ids[1][0] == NULL_BLOCK_ID and hit.block_ids[1][2] == window_blocks[2]
    assert hit.block_ids[1][1] not in (NULL_BLOCK_ID, *window_blocks, *kv.groups[1].table("f"))  # released, cached
    kv.free(a)
    kv.free(filler)
    assert kv.num_free_blocks == 15


def test_preemption_and_many_requests_leak_no_blocks():
    scheduler = _scheduler(num_blocks=14, block_size=4, budget=32)
    requests = [_add(scheduler, f"r{i}", [i * 50 + t for t in range(9)], max_tokens=12) for i in range(5)]
    for _ in range(200):
        if not scheduler.num_unfinished:
            break
        _step(scheduler)
    assert all(r.status.finished and r.num_output_tokens == 12 for r in requests)
    assert scheduler.num_preemptions > 0 and scheduler.kv.num_free_blocks == 13


def test_capacity_counts_a_window_and_a_step_per_sliding_group():
    kv = KVCacheManager(41, 4, False, FULL_AND_WINDOW)  # 40 usable: the window holds 3, the full group 37
    assert kv.capacity_tokens == 37 * 4
    assert KVCacheManager(41, 4, False).capacity_tokens == 40 * 4
    # steps of up to 9 tokens: a window holds 5 positions before a step and the step's 9: 5 blocks
    assert KVCacheManager(41, 4, False, FULL_AND_WINDOW, max_step_tokens=9).capacity_tokens == 35 * 4


def test_gemma3_layers_form_groups_of_equal_size():
    windows = tuple(None if (layer + 1) % 6 == 0 else 16 for layer in range(12))
    spec = KVCacheSpec((((2, 8), (2, 8)),) * 12, layer_windows=windows)
    groups = spec.layer_groups()
    assert groups[0] == LayerGroup("full_attention", (5, 11))
    assert [g.layers for g in groups[1:]] == [(0, 1), (2, 3), (4, 6), (7, 8), (9, 10)]
    assert all(g.kind == "sliding_window" and g.sliding_window == 16 for g in groups[1:])
    caches = spec.allocate(3, 4, torch.float32, torch.device("cpu"))
    assert caches[5] is caches[0] and caches[11] is caches[1] and caches[0] is not caches[1]
    assert spec.bytes_per_token(torch.float32) == 2 * 2 * 2 * 8 * 4  # 2 slots of K and V


def test_a_hit_in_one_group_is_never_handed_to_another_groups_new_blocks():
    """The window blocks a request released early sit at the front of the free queue; a later request whose prefix
    hit needs them takes them in its window group before the full-attention group takes fresh blocks."""
    kv = KVCacheManager(15, 4, True, FULL_AND_WINDOW)  # 14 usable blocks
    prompt = list(range(21))
    a = Request("a", prompt, SamplingParams(max_tokens=1))
    for num_computed, num_new in [(0, 8), (8, 8), (16, 5)]:  # the last chunk releases window blocks 0 and 1
        a.num_computed_tokens = num_computed
        assert kv.allocate_slots(a, num_new)
    kv.free(a)
    b = Request("b", prompt[:8] + [99] * 12, SamplingParams(max_tokens=1))
    hit = kv.find_cached_prefix(b)
    assert hit.num_blocks == 2 and NULL_BLOCK_ID not in hit.block_ids[1]  # a's released window blocks 0, 1
    b.num_computed_tokens = 8
    assert kv.allocate_slots(b, 12, hit)
    full, window = (group.table("b") for group in kv.groups)
    assert full[:2] == hit.block_ids[0] and window[:2] == hit.block_ids[1]
    assert not set(full) & set(window)  # no block in both groups
    assert all(kv.pool.ref_cnt[block] == 1 for block in full + window)


def test_a_window_block_two_requests_share_returns_once_both_have_moved_past_it():
    """b's prefix hit shares a's window blocks while a runs: a block goes back to the pool when the last request
    reading it moves past it, not before; the pool's free count is always what no request's table holds."""
    kv = KVCacheManager(64, 4, True, FULL_AND_WINDOW)  # 63 usable blocks, windows of 6
    a = Request("a", list(range(17)), SamplingParams(max_tokens=20))
    b = Request("b", list(range(16)) + [99], SamplingParams(max_tokens=20))
    full, window = kv.groups

    def held() -> set[int]:
        return {block for group in kv.groups for rid in ("a", "b") for block in group.table(rid)} - {NULL_BLOCK_ID}

    assert kv.allocate_slots(a, 16)  # a's 16 prompt tokens computed: four full blocks in each group, cached
    a.num_computed_tokens = 16
    hit = kv.find_cached_prefix(b)
    assert hit.num_blocks == 4
    b.num_computed_tokens = 16
    assert kv.allocate_slots(b, 1, hit)
    # the query at 16 reads keys 11..16: b shares a's window blocks 2 and 3 (not 0 and 1) and all four full blocks
    assert window.table("b")[:4] == [NULL_BLOCK_ID, NULL_BLOCK_ID, *window.table("a")[2:4]]
    assert full.table("b")[:4] == full.table("a")
    shared = window.table("a")[2]
    for num_computed in range(16, 26):  # a moves ahead one token at a time, b a token behind
        for request in (a, b) if num_computed > 16 else (a,):
            request.num_computed_tokens = num_computed - (request is b)
            assert kv.allocate_slots(request, 1)
            assert kv.num_free_blocks == 63 - len(held()), (request.request_id, num_computed)
        # block 2 (keys 8..11) is passed by a query at 17 or later: a leaves it at 17, b one step later
        assert (shared in window.table("a")) == (num_computed < 17)
        assert (shared in window.table("b")) == (num_computed < 18)
        assert (shared in held()) == (num_computed < 18)
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 63


def test_full_window_and_recurrent_groups_under_one_budget_leak_nothing():
    """All three kinds of layers in one manager (full attention, a window of 6, linear attention with kept states),
    stepped by hand: 8 requests, half sharing a 12-token prefix, in chunks of at most 8 tokens and a pool too small
    for all. After every schedule, each scheduled request's window table holds exactly the blocks from the one its
    next query reads on, the pool's free count is what no table holds, state slots belong to running requests only
    (one each), and a prefix hit's slot starts from a kept state; preemptions and prefix hits happen on the way;
    every block and slot is back at the end."""
    groups = (*FULL_AND_WINDOW, LayerGroup("recurrent_state", (2, 3)))
    kv = KVCacheManager(21, 4, True, groups, max_step_tokens=8, num_state_checkpoints=4)  # 20 usable blocks
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=16), kv)
    shared = list(range(1000, 1012))
    requests = [_add(scheduler, f"r{i}", (shared if i % 2 else []) + [i * 50 + t for t in range(5 + i)], max_tokens=6)
                for i in range(8)]  # fmt: skip
    full, window, states = kv.groups
    for _ in range(300):
        if not scheduler.num_unfinished:
            break
        output = scheduler.schedule()
        new_ids = {new.request_id for new in output.new_requests}
        for scheduled in output.scheduled:
            if scheduled.request_id in new_ids and scheduled.num_computed_tokens:  # a prefix hit: its state is kept
                assert scheduled.load_state_from is not None and scheduled.num_computed_tokens % 4 == 0
            table = window.table(scheduled.request_id)
            first_read = max(0, scheduled.num_computed_tokens - 5) // 4
            assert [i for i, b in enumerate(table) if b != NULL_BLOCK_ID] == list(range(first_read, len(table)))
            assert len(full.table(scheduled.request_id)) == len(table)
        held = {b for group in (full, window) for table in group.block_tables.values() for b in table} - {NULL_BLOCK_ID}
        assert kv.num_free_blocks == 20 - len(held)
        assert set(states.slots) <= {r.request_id for r in scheduler.running}
        assert len(set(states.slots.values())) == len(states.slots)
        sampled = {s.request_id: [7] for s in output.scheduled if s.needs_sample}
        scheduler.update_from_output(output, ModelRunnerOutput(sampled))
    assert all(r.status.finished and r.num_output_tokens == 6 for r in requests)
    assert scheduler.num_preemptions > 0 and any(r.num_cached_tokens for r in requests)
    assert kv.num_free_blocks == 20 and states.num_used_slots == 0
