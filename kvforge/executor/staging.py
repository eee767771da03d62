"""One host buffer for all of a step's inputs, moved to the device with one copy and split into typed views there.

A step lays out its parts (name, dtype, shape) back to back, each at an 8-byte boundary, fills them through numpy
views of the host buffer, then `send()` returns torch views of the same parts on the device:

    host (pinned)   | input_ids i64 [T] | positions i64 [T] | slot_mapping i64 [T] | ... | seq_lens i32 [N] |
                    ^0                  ^8T                 ^16T                            one copy of the used bytes
    device          | input_ids         | positions         | slot_mapping         | ... | seq_lens         |

On the CPU the device views are the host buffer itself: nothing is copied. On a GPU the host buffer is pinned and the
copy is asynchronous; before a later step writes into the host buffer again it waits for that copy (an event), so a
step never overwrites bytes still on their way. Both buffers grow (doubling) when a step needs more; a step's views
stay valid until the next step's `layout`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

_ALIGN = 8  # bytes: every part starts at a multiple of the largest element size
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.bool_): torch.bool}


class StagingBuffer:
    """A host buffer (pinned off the CPU) and its device twin; `layout` carves a step's parts, `send` moves them."""

    def __init__(self, device: torch.device, num_bytes: int = 1 << 16) -> None:
        self.device = device
        self._host = self._device = torch.empty(0, dtype=torch.uint8)
        self._copied: torch.cuda.Event | None = None  # the latest host-to-device copy (GPU only)
        self._parts: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {}
        self._used = 0
        self._grow(num_bytes)

    def _grow(self, num_bytes: int) -> None:
        on_cpu = self.device.type == "cpu"
        self._host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=not on_cpu)
        self._device = self._host if on_cpu else torch.empty(num_bytes, dtype=torch.uint8, device=self.device)

    def layout(self, parts: dict[str, tuple[np.dtype, tuple[int, ...]]]) -> dict[str, np.ndarray]:
        """The step's parts (name -> (dtype, shape)) as writable numpy views of the host buffer, in order."""
        offsets, offset = {}, 0
        for name, (dtype, shape) in parts.items():
            offsets[name] = offset
            offset += -(-np.dtype(dtype).itemsize * math.prod(shape) // _ALIGN) * _ALIGN
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the host buffer
        if offset > self._host.numel():
            self._grow(max(offset, 2 * self._host.numel()))
        host = self._host.numpy()
        views = {}
        self._parts = {}
        for name, (dtype, shape) in parts.items():
            dtype = np.dtype(dtype)
            start, size = offsets[name], dtype.itemsize * math.prod(shape)
            views[name] = host[start : start + size].view(dtype).reshape(shape)
            self._parts[name] = (start, _TORCH_DTYPES[dtype], tuple(shape))
        self._used = offset
        return views

    def send(self) -> dict[str, torch.Tensor]:
        """The parts of the latest layout on the device (one copy of the used bytes; none on the CPU)."""
        device = self._device
        if device is not self._host:
            device[: self._used].copy_(self._host[: self._used], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        tensors = {}
        for name, (start, dtype, shape) in self._parts.items():
            size = dtype.itemsize * math.prod(shape)
            tensors[name] = device[start : start + size].view(dtype).view(shape)
        return tensors
