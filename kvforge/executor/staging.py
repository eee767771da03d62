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

A step whose parts are those of the step before (most decode steps: the same requests, one token each) gets the same
views back, numpy and torch alike: no array or tensor is made per step then.
"""

from __future__ import annotations

import math

import numpy as np
import torch

_ALIGN = 8  # bytes: every part starts at a multiple of the largest element size
_TORCH_DTYPES = {np.int64: torch.int64, np.int32: torch.int32, np.bool_: torch.bool}


class StagingBuffer:
    """A host buffer (pinned off the CPU) and its device twin; `layout` carves a step's parts, `send` moves them."""

    def __init__(self, device: torch.device, num_bytes: int = 1 << 16) -> None:
        self.device = device
        self._copied: torch.cuda.Event | None = None  # the latest host-to-device copy (GPU only)
        self._layout: dict[str, tuple[type, tuple[int, ...]]] | None = None  # the latest layout's parts as asked
        self._views: dict[str, np.ndarray] = {}
        self._parts: dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]] = {}  # name -> (start, bytes, ...)
        self._sent: dict[str, torch.Tensor] | None = None  # the device views of the latest layout, once made
        self._used = 0
        self._grow(num_bytes)

    def _grow(self, num_bytes: int) -> None:
        on_cpu = self.device.type == "cpu"
        self._host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=not on_cpu)
        self._host_array = self._host.numpy()
        self._device = None if on_cpu else torch.empty(num_bytes, dtype=torch.uint8, device=self.device)

    def layout(self, parts: dict[str, tuple[type, tuple[int, ...]]]) -> dict[str, np.ndarray]:
        """The step's parts (name -> (numpy dtype, shape)) as writable numpy views of the host buffer, in order."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the host buffer
        if parts == self._layout:
            return self._views
        self._parts, offset = {}, 0
        for name, (dtype, shape) in parts.items():
            size = np.dtype(dtype).itemsize * math.prod(shape)
            self._parts[name] = (offset, size, _TORCH_DTYPES[dtype], shape)
            offset += -(-size // _ALIGN) * _ALIGN
        if offset > self._host_array.size:
            self._grow(max(offset, 2 * self._host_array.size))
        host = self._host_array
        self._views = {name: host[start : start + size].view(parts[name][0]).reshape(shape)
                       for name, (start, size, _, shape) in self._parts.items()}
        self._used = offset
        self._layout, self._sent = parts, None
        return self._views

    def send(self) -> dict[str, torch.Tensor]:
        """The parts of the latest layout on the device (one copy of the used bytes; none on the CPU)."""
        device = self._device
        if self._sent is None and device is None:  # the CPU: tensors over the host views themselves
            self._sent = {name: torch.from_numpy(view) for name, view in self._views.items()}
        elif self._sent is None:
            self._sent = {name: device[start : start + size].view(dtype).view(shape)
                          for name, (start, size, dtype, shape) in self._parts.items()}
        if device is not None:
            device[: self._used].copy_(self._host[: self._used], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        return self._sent
