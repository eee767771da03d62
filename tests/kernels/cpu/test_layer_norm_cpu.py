"""The CPU LayerNorm kernel with its fused residual add (csrc/layer_norm.cpp) against torch's layer_norm, its
vector code against its own scalar loop, and the inputs it leaves to the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvforge.kernels.cpu.extension import cpu_kernels
from kvforge.kernels.cpu.layer_ops import layer_norm_cpu
from kvforge.kernels.ops import op_table


@pytest.fixture(autouse=True)
def _built() -> None:
    assert cpu_kernels() is not None, "the C++ CPU kernels failed to build"


def _inputs(rows: int, hidden: int, offset: float = 0.0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(rows * 1000 + hidden)
    x = torch.randn(rows, hidden, generator=gen) * 3 + offset
    residual = torch.randn(rows, hidden, generator=gen)
    weight, bias = torch.rand(hidden, generator=gen) + 0.5, torch.randn(hidden, generator=gen)
    return x, residual, weight, bias


def _torch_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """torch's layer_norm in float64: the exact value the float32 kernel is within rounding of."""
    return F.layer_norm(x.double(), (x.shape[-1],), weight.double(), bias.double(), eps).float()


# hidden: MiniLM's and BERT-base's widths, a width with a tail past the 16-float vectors, one under a vector
@pytest.mark.parametrize("rows, hidden", [(1, 384), (37, 40), (64, 768), (5, 7), (0, 16)])
@pytest.mark.parametrize("offset", [0.0, 1000.0], ids=["centred", "far-from-zero"])
def test_layer_norm_matches_torch(rows: int, hidden: int, offset: float) -> None:
    x, residual, weight, bias = _inputs(rows, hidden, offset)
    got, exact = layer_norm_cpu(x, weight, bias, 1e-12), _torch_layer_norm(x, weight, bias, 1e-12)
    torch.testing.assert_close(got, exact, atol=1e-4, rtol=1e-4)
    if rows:  # no further from the exact values than torch's own float32 layer_norm
        torch_error = (F.layer_norm(x, (hidden,), weight, bias, 1e-12) - exact).abs().max().item()
        assert (got - exact).abs().max().item() <= 2 * torch_error + 1e-6
    fused = layer_norm_cpu(x, weight, bias, 1e-12, residual)
    torch.testing.assert_close(fused, _torch_layer_norm(x + residual, weight, bias, 1e-12), atol=1e-4, rtol=1e-4)
    # the vector code against the build's own scalar loop: the same sums in another order
    scalar = torch.ops.kvforge_cpu.layer_norm_scalar(x, residual, weight, bias, 1e-12)
    torch.testing.assert_close(fused, scalar, atol=1e-4, rtol=1e-4)


def test_strided_rows_and_rows_of_a_batch() -> None:
    """A slice of a wider tensor (strided rows) and a [batch, tokens, hidden] input."""
    x, residual, weight, bias = _inputs(12, 64)
    wide = torch.randn(12, 100)
    wide[:, :64] = x
    got = layer_norm_cpu(wide[:, :64], weight, bias, 1e-5, residual)
    torch.testing.assert_close(got, _torch_layer_norm(x + residual, weight, bias, 1e-5), atol=1e-4, rtol=1e-4)
    batched = layer_norm_cpu(x.view(3, 4, 64), weight, bias, 1e-5)
    assert batched.shape == (3, 4, 64)
    torch.testing.assert_close(batched.view(12, 64), _torch_layer_norm(x, weight, bias, 1e-5), atol=1e-4,
                               rtol=1e-4)


def test_other_dtypes_take_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    op = torch.ops.kvforge_cpu.layer_norm
    monkeypatch.setattr(torch.ops.kvforge_cpu, "layer_norm", lambda *args: calls.append(1) or op(*args))
    x, residual, weight, bias = (t.to(torch.bfloat16) for t in _inputs(4, 32))
    got = layer_norm_cpu(x, weight, bias, 1e-5, residual)
    assert got.dtype == torch.bfloat16 and calls == []
    torch.testing.assert_close(got, F.layer_norm(x + residual, (32,), weight, bias, 1e-5), atol=0, rtol=0)
    assert op_table("torch").layer_norm is layer_norm_cpu
    layer_norm_cpu(*(t.float() for t in (x, weight, bias)), 1e-5)
    assert calls == [1]
