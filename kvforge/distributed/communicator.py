"""The collectives the engine uses, over the groups of a ParallelState. With one rank they are no-ops.

Callers pass the state they captured when they were built, so a single-device engine and a
distributed one can live in the same process.

    tp_all_reduce                    tensor-parallel layers (row-parallel outputs, vocabulary shards)
    tp_gather                        the LM head's logits, to the rank that samples
    send_tensor / recv_tensor        hidden states from one pipeline stage to the next
    send_object / recv_object        pickled commands and results between the driver and the ranks

Sends are asynchronous (`isend`): the sender goes on with its next micro-batch while the receiver
catches up; the tensor is kept alive until the transfer completes. Receives block.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from kvforge.distributed.parallel_state import ParallelState

# Message kinds; point-to-point messages of one kind arrive in the order they were sent.
TAG_COMMAND = 1
TAG_HIDDEN = 2
TAG_RESULT = 3

_in_flight: list[tuple[dist.Work, torch.Tensor]] = []


def tp_all_reduce(state: ParallelState, x: torch.Tensor) -> torch.Tensor:
    """Sum x over the tensor-parallel group, in place."""
    if state.tp_size > 1:
        dist.all_reduce(x, group=state.tp_group)
    return x


def tp_gather(state: ParallelState, x: torch.Tensor) -> torch.Tensor | None:
    """Every rank's x concatenated along the last dimension on tensor-parallel index 0; None elsewhere."""
    if state.tp_size == 1:
        return x
    x = x.contiguous()
    first = state.pp_rank * state.tp_size
    parts = [torch.empty_like(x) for _ in range(state.tp_size)] if state.tp_rank == 0 else None
    dist.gather(x, parts, dst=first, group=state.tp_group)
    return None if parts is None else torch.cat(parts, dim=-1)


def _isend(tensor: torch.Tensor, dst: int, tag: int, group: dist.ProcessGroup | None) -> None:
    global _in_flight
    _in_flight = [(work, t) for work, t in _in_flight if not work.is_completed()]
    _in_flight.append((dist.isend(tensor, dst=dst, group=group, tag=tag), tensor))


def wait_for_sends() -> None:
    """Block until every asynchronous send of this process has been received."""
    global _in_flight
    for work, _ in _in_flight:
        work.wait()
    _in_flight = []


def forget_sends() -> None:
    """Drop the record of pending sends without waiting (their peer is gone)."""
    _in_flight.clear()


def send_tensor(state: ParallelState, x: torch.Tensor, dst: int) -> None:
    _isend(x.contiguous(), dst, TAG_HIDDEN, state.pp_group)


def recv_tensor(state: ParallelState, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                src: int) -> torch.Tensor:
    x = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(x, src=src, group=state.pp_group, tag=TAG_HIDDEN)
    return x


def send_object(state: ParallelState, obj: Any, dst: int, tag: int) -> None:
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    group = state.cpu_group
    _isend(torch.tensor([payload.numel()], dtype=torch.int64), dst, tag, group)
    _isend(payload, dst, tag, group)


def recv_object(state: ParallelState, src: int, tag: int) -> Any:
    group = state.cpu_group
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src=src, group=group, tag=tag)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(payload, src=src, group=group, tag=tag)
    return pickle.loads(payload.numpy().tobytes())
