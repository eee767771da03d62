"""Import Triton once, the way this machine can run it.

Without a GPU, Triton kernels can only run in the interpreter (`TRITON_INTERPRET=1`), and that has to
be chosen before triton is first imported. Without triton installed, kernels are still defined (as
plain functions) so that the torch references beside them import; `require_triton` guards launches.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)

if not torch.cuda.is_available() and "triton" not in sys.modules:
    # NOTE: an explicit TRITON_INTERPRET=0 is respected; launches on CPU tensors then fail in triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference path needs no triton
    triton = None
    tl = None

HAS_TRITON = triton is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def jit(fn: F) -> F:
    """`triton.jit` when triton is installed; otherwise the plain function, never launched."""
    return triton.jit(fn) if HAS_TRITON else fn


def constexpr(value: float | int):
    """A module-level constant that kernels may read: compiled kernels only see tl.constexpr globals
    (the interpreter sees any global, so only compiling for a GPU catches a plain one)."""
    return tl.constexpr(value) if HAS_TRITON else value


def require_triton() -> None:
    if not HAS_TRITON:
        raise ValueError("this op's Triton kernel needs triton, which is not installed (pip install triton)")


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
