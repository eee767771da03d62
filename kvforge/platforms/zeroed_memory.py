"""Zeroed host memory that takes no resident memory until it is written: a private anonymous mapping of its own.

torch.zeros writes every byte at once, so a tensor that is mostly never written (a KV cache sized for many long
sequences that serves one short one) is resident whole from the start. The kernel hands an anonymous mapping out as
zero pages and backs each page with memory at its first write: the same zeros, resident as they are used. The
mapping lives as long as a view of the tensor does.
"""

from __future__ import annotations

import mmap
import operator
from functools import reduce

import torch


def zeroed_memory(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of nbytes zeros (at least one page mapped), backed page by page as it is first written."""
    memory = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE)  # anonymous: zero pages until written
    return torch.frombuffer(memory, dtype=torch.uint8)[:nbytes]


def zeroed_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype) on the CPU, in zeroed_memory."""
    nbytes = reduce(operator.mul, shape, 1) * dtype.itemsize
    return zeroed_memory(nbytes).view(dtype).view(shape)
