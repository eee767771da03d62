"""The bfloat16-product GEMM (csrc/bf16_gemm.cpp) against torch's float32 matmul of the bfloat16-rounded x and
weight, with each activation it applies; and how far that stays from the float32 product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvforge.kernels.cpu.bf16_gemm import bf16_linear, bf16_linear_ref, bf16_matmuls_supported, pack_bf16

ACTIVATIONS = {None: lambda y: y, "gelu": F.gelu, "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"),
               "relu": F.relu}


@pytest.fixture(autouse=True)
def _supported() -> None:
    if not bf16_matmuls_supported():
        pytest.skip("this CPU has no AMX-BF16 (or the kernels are built without it)")


def _inputs(rows: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows * 7 + k * 3 + n)
    x = torch.randn(rows, k, generator=gen) * 2
    return x, torch.randn(n, k, generator=gen) / k**0.5, torch.randn(n, generator=gen)


# rows: one, a tail past the 32-row blocks, MiniLM's batch-64 step; K past one chunk of inputs (384) and with a
# partial one; N of several column blocks (MiniLM's QKV 1152, up 1536)
@pytest.mark.parametrize("rows, k, n", [(1, 32, 32), (37, 384, 1152), (70, 1536, 384), (33, 416, 1536), (0, 64, 32)])
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_bf16_gemm_matches_rounded_float32(rows: int, k: int, n: int, activation: str | None) -> None:
    x, weight, bias = _inputs(rows, k, n)
    got = bf16_linear(x, pack_bf16(weight), bias, activation)
    expected = ACTIVATIONS[activation](bf16_linear_ref(x, weight, bias))
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)  # the same products, summed in another order
    if rows:  # bfloat16 inputs: off the float32 product by about 2^-8 of the terms' size, far from it otherwise
        error = (got - ACTIVATIONS[activation](F.linear(x, weight, bias))).abs().max().item()
        assert 1e-5 < error < 0.05


def test_without_bias_and_on_strided_rows() -> None:
    x, weight, _ = _inputs(40, 128, 64)
    wide = torch.cat([x, x], dim=1)[:, :128]  # rows of stride 256
    torch.testing.assert_close(bf16_linear(wide, pack_bf16(weight), None), bf16_linear_ref(x, weight, None),
                               atol=2e-5, rtol=1e-5)


def test_pack_refuses_partial_blocks() -> None:
    with pytest.raises(RuntimeError, match="multiples of 32"):
        pack_bf16(torch.randn(48, 64))
