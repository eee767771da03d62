"""Kernel tests run the Triton kernels in the interpreter on the CPU, or natively on a GPU when
KVFORGE_TEST_DEVICE=cuda (scripts/gpu_kernels.sh). The interpreter has to be chosen before triton is
first imported, which is why this happens at conftest import time."""

from __future__ import annotations

import os

import pytest
import torch

TEST_DEVICE = os.environ.get("KVFORGE_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def device() -> torch.device:
    if TEST_DEVICE != "cpu" and not torch.cuda.is_available():
        pytest.skip(f"KVFORGE_TEST_DEVICE={TEST_DEVICE} but no GPU is visible")
    return torch.device(TEST_DEVICE)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
