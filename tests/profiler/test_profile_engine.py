"""`kvforge profile` on a small random Llama: the op classes explain the model time, the host parts and the
model the step time; each GEMM's FLOPs and bytes are the shapes' arithmetic; nothing is left installed."""

from __future__ import annotations

import pytest

from kvforge.benchmarks.workload import random_workload
from kvforge.profiler.report import coverage
from kvforge.profiler.session import profile_engine

# NOTE: wider than tests/tiny_models.py's default, so that its matmuls take most of a step (as in real
# models): 2 layers, 16 query heads and 4 KV heads of 64.
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 1024, 4096, 2, 16, 4, 64
QKV_ROWS = (HEADS + 2 * KV_HEADS) * HEAD_DIM
FP32 = 4


@pytest.fixture(scope="module")
def eager_llm(tmp_path_factory):
    from kvforge import LLM
    from tests.tiny_models import save_model

    folder = tmp_path_factory.mktemp("llama-1024")
    save_model(folder, "llama", hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=HEADS,
               num_key_value_heads=KV_HEADS)
    llm = LLM(str(folder), kv_cache_memory="16MiB", enforce_eager=True)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module", params=[1, 6], ids=["single-stream", "six-streams"])
def profiled(request, eager_llm):
    workload = random_workload(request.param, (8, 40), 12, seed=request.param, vocab_range=(5, 300))
    return profile_engine(eager_llm.engine, workload, concurrency=0, trace_path=None).steps


def test_op_classes_add_up_to_model_time_and_host_plus_model_to_step_time(profiled) -> None:
    assert {s.kind for s in profiled} >= {"prefill", "decode"}
    model_share, step_share = coverage(profiled)
    assert model_share >= 0.9, f"op classes explain only {model_share:.1%} of the model time"
    assert step_share >= 0.9, f"host parts and the model explain only {step_share:.1%} of the step time"
    for step in profiled:
        assert sum(step.seconds.values()) == pytest.approx(step.wall_s, rel=1e-6)
        assert 0 < step.model_s < step.wall_s
        assert step.seconds["gemm.mlp"] > 0 and step.seconds["host.schedule"] > 0
        # an eager forward's own Python (the layer loop, module calls) is named, not left as model.other
        assert step.seconds["model.python"] > step.seconds.get("model.other", 0.0)


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
    kv_bytes_per_token = 2 * KV_HEADS * HEAD_DIM * 2  # keys and values, in the CPU's default float16 cache
    context = attention.flops / (LAYERS * 4 * HEADS * HEAD_DIM)  # 4 heads x head_dim FLOPs per (query, key) pair
    assert context == int(context) >= decode.num_seqs * 9  # every prompt has at least 8 tokens
    queries_and_outputs = decode.num_seqs * 2 * HEADS * HEAD_DIM * FP32
    assert attention.bytes == LAYERS * (context * kv_bytes_per_token + queries_and_outputs)
    assert "attention.prefill" not in decode.seconds


def test_nothing_stays_installed(eager_llm, profiled) -> None:
    from kvforge.distributed import communicator
    from kvforge.layers import linear

    engine = eager_llm.engine
    assert not [name for name, m in engine.runner.model.named_modules() if "forward" in vars(m)]
    assert "schedule" not in vars(engine.scheduler) and "execute" not in vars(engine.runner)
    tables = [vars(m)["ops"] for m in engine.runner.model.modules() if "ops" in vars(m)]
    assert tables and not [t for t in tables if hasattr(t.silu_and_mul, "__wrapped__")]
    assert linear.tp_all_reduce is communicator.tp_all_reduce
    assert eager_llm.generate([[5, 6, 7]], None)[0].outputs[0].token_ids
