"""`kvforge profile` on a tiny Llama: the op classes explain the model time, the host parts and the model
the step time; each GEMM's FLOPs and bytes are the shapes' arithmetic; nothing is left installed."""

from __future__ import annotations

import pytest

from kvforge.benchmarks.workload import random_workload
from kvforge.profiler.report import coverage
from kvforge.profiler.session import profile_engine

# tests/tiny_models.py: hidden 64, intermediate 128, 2 layers, 4 query heads and 2 KV heads of 16
HIDDEN, INTER, LAYERS, QKV_ROWS = 64, 128, 2, (4 + 2 * 2) * 16
FP32 = 4


@pytest.fixture(scope="module", params=[1, 6], ids=["single-stream", "six-streams"])
def profiled(request, tiny_llm):
    workload = random_workload(request.param, (8, 40), 12, seed=request.param, vocab_range=(5, 400))
    return profile_engine(tiny_llm.engine, workload, concurrency=0, trace_path=None).steps


def test_op_classes_add_up_to_model_time_and_host_plus_model_to_step_time(profiled) -> None:
    assert {s.kind for s in profiled} >= {"prefill", "decode"}
    model_share, step_share = coverage(profiled)
    assert model_share >= 0.9, f"op classes explain only {model_share:.1%} of the model time"
    assert step_share >= 0.9, f"host parts and the model explain only {step_share:.1%} of the step time"
    for step in profiled:
        assert sum(step.seconds.values()) == pytest.approx(step.wall_s, rel=1e-6)
        assert 0 < step.model_s < step.wall_s
        assert step.seconds["gemm.mlp"] > 0 and step.seconds["host.schedule"] > 0


def test_each_gemm_moves_the_bytes_and_flops_of_its_shapes(profiled) -> None:
    vocab = None
    for step in profiled:
        tokens, work = step.num_tokens, step.work
        assert work["gemm.qkv"].flops == LAYERS * 2 * tokens * QKV_ROWS * HIDDEN
        assert work["gemm.qkv"].bytes == LAYERS * (QKV_ROWS * HIDDEN + tokens * (HIDDEN + QKV_ROWS)) * FP32
        assert work["gemm.o"].flops == LAYERS * 2 * tokens * HIDDEN * HIDDEN
        mlp = [(2 * INTER, HIDDEN), (HIDDEN, INTER)]  # gate|up, down: (N, K)
        assert work["gemm.mlp"].flops == LAYERS * sum(2 * tokens * n * k for n, k in mlp)
        assert work["gemm.mlp"].bytes == LAYERS * sum((n * k + tokens * (n + k)) * FP32 for n, k in mlp)
        head = work["gemm.lm_head"]  # one row per sequence that samples: every one of them here
        vocab = vocab or head.flops // (2 * step.num_seqs * HIDDEN)
        assert head.flops == 2 * step.num_seqs * vocab * HIDDEN
        assert head.bytes == (vocab * HIDDEN + step.num_seqs * (HIDDEN + vocab)) * FP32
    assert 256 < vocab <= 512


def test_decode_attention_reads_each_sequences_context(profiled) -> None:
    decode = next(s for s in profiled if s.kind == "decode")
    attention = decode.work["attention.decode"]
    kv_bytes_per_token = 2 * 2 * 16 * FP32  # keys and values of 2 KV heads
    context = attention.flops / (LAYERS * 4 * 4 * 16)  # 4 heads x head_dim FLOPs per (query, key) pair
    assert attention.bytes == LAYERS * (context * kv_bytes_per_token + decode.num_seqs * 2 * 4 * 16 * FP32)
    assert "attention.prefill" not in decode.seconds


def test_nothing_stays_installed(tiny_llm, profiled) -> None:
    from kvforge.distributed import communicator
    from kvforge.layers import linear

    engine = tiny_llm.engine
    assert not [name for name, m in engine.runner.model.named_modules() if "forward" in vars(m)]
    assert "schedule" not in vars(engine.scheduler) and "execute" not in vars(engine.runner)
    tables = [vars(m)["ops"] for m in engine.runner.model.modules() if "ops" in vars(m)]
    assert tables and not [t for t in tables if hasattr(t.silu_and_mul, "__wrapped__")]
    assert linear.tp_all_reduce is communicator.tp_all_reduce
    out = tiny_llm.generate([[5, 6, 7]], None)[0].outputs[0]
    assert out.token_ids
