"""The CPU kernels for RMSNorm, SiLU-and-mul and rotary embedding (csrc/layer_ops.cpp) against their torch
references, and the choice between them: the kernel eagerly, the reference under torch.compile."""

from __future__ import annotations

import threading

import pytest
import torch

from kvforge.kernels.activation import silu_and_mul_ref
from kvforge.kernels.cpu.extension import cpu_kernels
from kvforge.kernels.cpu.layer_ops import (
    fused_add_rms_norm_cpu,
    rms_norm_cpu,
    rotary_embedding_cpu,
    silu_and_mul_cpu,
)
from kvforge.kernels.ops import op_table
from kvforge.kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_ref
from kvforge.kernels.rotary import rotary_embedding_ref
from kvforge.layers.rotary import build_cos_sin_cache

# fp32: the kernels sum a row in another order than torch; bf16/fp16: they round where the references do, so a
# value differs by at most one unit in the last place from the sum's order.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
             torch.float16: dict(atol=2e-3, rtol=2e-3)}
DTYPES = list(TOLERANCE)


@pytest.fixture(autouse=True)
def _built() -> None:
    assert cpu_kernels() is not None, "the C++ CPU kernels failed to build"


def _kernel_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Counts the calls of torch.ops.kvforge_cpu.<name> from now on."""
    calls: list[int] = []
    op = getattr(torch.ops.kvforge_cpu, name)

    def counted(*args):
        calls.append(1)
        return op(*args)

    monkeypatch.setattr(torch.ops.kvforge_cpu, name, counted)
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [(1, 576), (37, 40), (300, 64), (0, 16)])
def test_rms_norm_matches_reference(dtype: torch.dtype, rows: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    torch.testing.assert_close(rms_norm_cpu(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), **TOLERANCE[dtype])
    out, new_residual = fused_add_rms_norm_cpu(x, residual, weight, 1e-6)
    expected_out, expected_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)
    torch.testing.assert_close(out, expected_out, **TOLERANCE[dtype])


def test_rms_norm_takes_heads_and_strided_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3's per-head norm passes [tokens * heads, head_dim]; a split of a wider tensor has strided rows."""
    calls = _kernel_calls(monkeypatch, "rms_norm")
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(5, 3, 100, generator=gen)
    x = wide[..., :64]  # rows of 64 at a stride of 100
    weight = torch.rand(64, generator=gen)
    torch.testing.assert_close(rms_norm_cpu(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), **TOLERANCE[torch.float32])
    assert calls == [1]


def test_rms_norm_weight_in_another_dtype_takes_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _kernel_calls(monkeypatch, "rms_norm")
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    weight = torch.rand(32)
    got = rms_norm_cpu(x, weight, 1e-5)
    assert got.dtype == torch.float32 and calls == []
    torch.testing.assert_close(got, rms_norm_ref(x, weight, 1e-5), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, d", [(1, 1536), (33, 40), (7, 3)])
def test_silu_and_mul_matches_reference(dtype: torch.dtype, rows: int, d: int) -> None:
    gen = torch.Generator().manual_seed(rows + d)
    x = (torch.randn(rows, 2 * d, generator=gen) * 6).to(dtype)
    x[0, 0], x[0, -1] = -200.0, 200.0  # far outside exp's range in either direction
    torch.testing.assert_close(silu_and_mul_cpu(x), silu_and_mul_ref(x), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("head_dim, rot_dim", [(64, 64), (128, 64), (40, 40)])
def test_rotary_matches_reference(dtype: torch.dtype, is_neox: bool, head_dim: int, rot_dim: int) -> None:
    """Query and key are views of one fused QKV output, as the attention layer passes them."""
    tokens, heads, kv_heads = 19, 6, 2
    gen = torch.Generator().manual_seed(head_dim + rot_dim)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    query = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    key = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    cache = build_cos_sin_cache(rot_dim, 4096, 10000.0, None)
    for positions in (torch.randint(0, 4096, (tokens,), generator=gen), torch.arange(tokens, dtype=torch.int32)):
        got = rotary_embedding_cpu(positions, query, key, cache, is_neox)
        expected = rotary_embedding_ref(positions, query, key, cache, is_neox)
        for g, e in zip(got, expected):
            assert g.shape == e.shape and g.dtype == e.dtype and g.is_contiguous()
            torch.testing.assert_close(g, e, **TOLERANCE[dtype])


def test_rotary_position_outside_the_table_raises() -> None:
    query, key = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    cache = build_cos_sin_cache(8, 16, 10000.0, None)
    with pytest.raises(RuntimeError, match="position 16 outside the table's 16"):
        rotary_embedding_cpu(torch.tensor([3, 16]), query, key, cache, True)


def test_compiled_code_traces_the_references() -> None:
    """Under torch.compile the ops table's entries trace the references (the captured graph calls no kernel, so
    Inductor fuses them), and the compiled result equals the eager kernels' result."""
    ops = op_table("torch")
    assert ops.rms_norm is rms_norm_cpu and ops.silu_and_mul is silu_and_mul_cpu
    gen = torch.Generator().manual_seed(1)
    hidden, inter = 32, 48
    x, residual = torch.randn(6, hidden, generator=gen), torch.randn(6, hidden, generator=gen)
    weight, up = torch.rand(hidden, generator=gen), torch.randn(hidden, 2 * inter, generator=gen)
    qkv = torch.randn(6, 3 * 16, generator=gen)
    positions, cache = torch.arange(6), build_cos_sin_cache(16, 64, 10000.0, None)

    def block(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, ...]:
        normed, residual = ops.fused_add_rms_norm(x, residual, weight, 1e-5)
        q, k = ops.rotary_embedding(positions, qkv[:, :32].view(6, 2, 16), qkv[:, 32:].view(6, 1, 16), cache, True)
        return ops.rms_norm(ops.silu_and_mul(normed @ up), torch.ones(inter), 1e-5), residual, q, k

    graphs: list[torch.fx.GraphModule] = []

    def capture(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        graphs.append(graph)
        return graph.forward

    compiled = torch.compile(block, fullgraph=True, dynamic=False, backend=capture)(x, residual)
    targets = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert targets and not any("kvforge_cpu" in target for target in targets), targets
    for got, expected in zip(compiled, block(x, residual)):
        torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])


def test_eager_calls_run_the_kernels_while_another_thread_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode bucket compiles on a thread of its own while the engine's steps run eagerly: those steps keep the
    kernels (torch.compiler.is_compiling() is one flag for the whole process while any thread compiles)."""
    compiling, release = threading.Event(), threading.Event()

    def held_backend(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        compiling.set()
        release.wait(60)
        return graph.forward

    compile_thread = threading.Thread(
        target=lambda: torch.compile(lambda x: x * 2, fullgraph=True, backend=held_backend)(torch.ones(3)))
    compile_thread.start()
    try:
        assert compiling.wait(60)
        calls = _kernel_calls(monkeypatch, "rms_norm")
        x, weight = torch.randn(4, 64), torch.rand(64)
        torch.testing.assert_close(rms_norm_cpu(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6),
                                   **TOLERANCE[torch.float32])
        assert calls == [1]
    finally:
        release.set()
        compile_thread.join()
