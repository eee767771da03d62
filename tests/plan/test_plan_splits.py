"""The planner on the shipped big-model configs: parameter counts against the published ones, how TP and PP
cut weights and KV cache, and what the roofline says at the edges (batch 1, no room)."""

from __future__ import annotations

import pytest

from kvforge.plan import PlanOptions, get_device, load_model_shape, make_plan, resolve_precision
from kvforge.plan.estimate import split_problem

GIB = 2**30


@pytest.fixture(scope="module")
def llama70b():
    return load_model_shape("llama-3-70b")


@pytest.fixture(scope="module")
def deepseek_v3():
    return load_model_shape("deepseek-v3")


def _plan(shape, device_type="h200", weight_dtype="auto", kv_dtype="auto", **options):
    device = get_device(device_type)
    precision = resolve_precision(weight_dtype, kv_dtype, shape.checkpoint_format, device)
    return make_plan(shape, device, precision, PlanOptions(**options))


def _split(plan, tp, pp):
    return next(s for s in plan.splits if (s.tp, s.pp) == (tp, pp))


@pytest.mark.parametrize(
    ("name", "total_b", "active_b"),
    [
        # published totals: Llama 3 70B 70.6B; Mixtral 8x7B 46.7B total, 12.9B active;
        # DeepSeek-V3 671B total, 37B active (the multi-token-prediction module aside)
        ("llama-3-70b", 70.55, 70.55),
        ("mixtral-8x7b", 46.70, 12.88),
        ("deepseek-v3", 671.0, 37.5),
    ],
)
def test_parameter_counts_match_published(name, total_b, active_b):
    shape = load_model_shape(name)
    assert shape.total_params / 1e9 == pytest.approx(total_b, rel=0.005)
    assert shape.active_params / 1e9 == pytest.approx(active_b, rel=0.02)


def test_llama70b_weights_and_kv_split_over_tensor_parallel_ranks(llama70b):
    plan = _plan(llama70b, num_devices=8, context_len=4096)
    assert [(s.tp, s.pp) for s in plan.splits] == [(1, 8), (2, 4), (4, 2), (8, 1)]
    tp8 = _split(plan, 8, 1)
    # bf16: 141.1 GB of weights, an eighth per rank; 80 layers x 8 KV heads x 128 x 2 (k, v) x 2 bytes
    # = 320 KiB of KV cache per token, one KV head (40 KiB) per rank
    assert tp8.memory.weights == pytest.approx(70.55e9 * 2 / 8, rel=0.01)
    assert tp8.memory.kv_bytes_per_token == 40 * 1024
    assert tp8.fits and plan.recommended is tp8


def test_kv_heads_are_replicated_when_ranks_outnumber_them(llama70b):
    plan = _plan(llama70b, num_devices=16, context_len=4096)
    assert _split(plan, 16, 1).memory.kv_bytes_per_token == 40 * 1024  # still one of the 8 heads each
    assert _split(plan, 8, 2).memory.kv_bytes_per_token == 20 * 1024  # one head, half the layers


def test_latent_cache_is_whole_on_every_rank(deepseek_v3):
    plan = _plan(deepseek_v3, num_devices=8, context_len=4096)
    assert deepseek_v3.checkpoint_format == "fp8"
    # 61 layers x (512 latent + 64 rope key) x 2 bytes, whatever the tensor-parallel size
    assert _split(plan, 8, 1).memory.kv_bytes_per_token == 61 * 576 * 2
    assert _split(plan, 1, 8).memory.kv_bytes_per_token == pytest.approx(61 * 576 * 2 / 8, rel=0.1)
    # fp8 weights (embedding and LM head in bf16): about 671 GB / 8 per device
    assert _split(plan, 8, 1).memory.weights / 1e9 == pytest.approx(671 / 8, rel=0.05)


def test_single_sequence_with_pipeline_stages_reads_all_weights_per_token(llama70b):
    """Batch 1 cannot fill a pipeline: every token waits for all eight stages in turn."""
    plan = _plan(llama70b, num_devices=8, context_len=1024, batch_size=1)
    weights_read_ms = 70.55e9 * 2 / 4800e9 * 1e3  # every weight once per token over one device's HBM
    assert _split(plan, 1, 8).decode.latency_ms == pytest.approx(weights_read_ms, rel=0.1)
    tp8 = _split(plan, 8, 1).decode
    assert weights_read_ms / 8 < tp8.latency_ms < weights_read_ms / 2  # all-reduces cost something
    assert tp8.comm_share > 0 and _split(plan, 1, 8).decode.comm_share == 0


def test_fp8_kv_cache_doubles_the_tokens_that_fit(llama70b):
    # 1024 sequences of 8192 tokens need more than the memory left, in either dtype: the memory sets the size
    bf16 = _split(_plan(llama70b, num_devices=8, max_num_seqs=1024), 8, 1).memory
    fp8 = _split(_plan(llama70b, num_devices=8, max_num_seqs=1024, kv_dtype="fp8"), 8, 1).memory
    assert fp8.kv_tokens == pytest.approx(2 * bf16.kv_tokens, rel=0.05)  # a float32 scale per 128 values


def test_a_cache_sized_by_default_holds_what_the_sequences_need_and_no_more(llama70b):
    """As the engine sizes it: 256 sequences of Llama-3-70B's 8192 tokens fit 8 H200s with room to spare, so the
    cache holds exactly them; on one CPU, the engine's 2 GiB default budget."""
    tp8 = _split(_plan(llama70b, num_devices=8), 8, 1).memory
    assert tp8.kv_tokens == 256 * 8192
    assert tp8.kv_cache == 256 * 8192 * 40 * 1024
    small = load_model_shape(None)  # the default model
    on_cpu = _split(_plan(small, device_type="cpu"), 1, 1).memory
    assert on_cpu.kv_cache <= 2 * 2**30 and on_cpu.kv_tokens == 2 * 2**30 // on_cpu.kv_bytes_per_token


def test_model_too_big_for_the_devices_fits_no_split(llama70b):
    plan = _plan(llama70b, device_type="l40s", num_devices=2, context_len=1024)
    assert plan.recommended is None
    assert all("weights and activations need" in s.problem for s in plan.splits)
    assert plan.reason.startswith("no split fits")


def test_requested_batch_beyond_the_cache_is_reported(llama70b):
    plan = _plan(llama70b, num_devices=8, context_len=8192, batch_size=10_000)
    assert all(not s.fits and "KV cache holds" in s.problem for s in plan.splits)


def test_splits_that_do_not_divide_the_heads_are_invalid():
    shape = load_model_shape(None)  # 9 attention heads, 3 KV heads
    assert split_problem(shape, 2, 1) == "TP=2 does not divide 9 (heads or intermediate size)"
    assert split_problem(shape, 3, 1) is None
    assert split_problem(shape, 1, 31) == "PP=31 exceeds the 30 layers"
    plan = _plan(shape, device_type="h100", num_devices=2)
    assert _split(plan, 2, 1).problem is not None and _split(plan, 1, 2).fits


def test_moe_decode_reads_only_the_experts_its_tokens_chose(deepseek_v3):
    one = _split(_plan(deepseek_v3, num_devices=8, context_len=128, batch_size=1), 8, 1).decode
    many = _split(_plan(deepseek_v3, num_devices=8, context_len=128, batch_size=128), 8, 1).decode
    # one token reads 8 of 256 routed experts; 128 tokens nearly all of them
    assert one.latency_ms < 0.4 * many.latency_ms
