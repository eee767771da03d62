"""The CPU greedy-id kernel (csrc/argmax.cpp) against torch's max(dim=-1).indices: the first maximum of every
row, NaN counted as the maximum, at widths around its 16-lane vectors."""

from __future__ import annotations

import pytest
import torch

from kvforge.kernels.cpu.argmax import argmax_rows, argmax_rows_ref
from kvforge.kernels.cpu.extension import cpu_kernels


@pytest.fixture(autouse=True)
def _built() -> None:
    assert cpu_kernels() is not None, "the C++ CPU kernels failed to build"


def _kernel(logits: torch.Tensor) -> torch.Tensor:
    return torch.ops.kvforge_cpu.argmax_rows(logits)


@pytest.mark.parametrize("width", [1, 7, 16, 17, 33, 49152])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_random_rows(rows: int, width: int) -> None:
    logits = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows * width))
    assert torch.equal(_kernel(logits), argmax_rows_ref(logits))


def test_ties_go_to_the_first_maximum() -> None:
    logits = torch.zeros(4, 100)
    logits[1, [3, 40, 99]] = 5.0  # in lanes 3, 8 and 3 of their vectors
    logits[2, [98, 17]] = 2.0  # the later one in the tail
    logits[3] = float("-inf")
    expected = torch.tensor([0, 3, 17, 0])
    assert torch.equal(_kernel(logits), expected) and torch.equal(argmax_rows_ref(logits), expected)


def test_a_nan_is_the_maximum() -> None:
    logits = torch.randn(3, 70, generator=torch.Generator().manual_seed(0))
    logits[0, [50, 21]] = float("nan")
    logits[1, 69] = float("nan")  # in the tail
    logits[2, [5, 6]] = torch.tensor([float("inf"), float("nan")])
    assert torch.equal(_kernel(logits), argmax_rows_ref(logits))
    assert _kernel(logits).tolist() == [21, 69, 6]


def test_the_dispatch_keeps_other_inputs_on_the_reference() -> None:
    logits = torch.randn(3, 50, dtype=torch.bfloat16)
    assert torch.equal(argmax_rows(logits), argmax_rows_ref(logits))
    strided = torch.randn(50, 3).t()  # not contiguous: the kernel gets a contiguous copy
    assert torch.equal(argmax_rows(strided), argmax_rows_ref(strided))
    with pytest.raises(RuntimeError, match="no elements"):
        _kernel(torch.empty(2, 0))
