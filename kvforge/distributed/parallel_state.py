"""This process's place in the tensor x pipeline grid, and the torch.distributed groups it talks over.

Global ranks are laid out stage by stage; the ranks of one stage form a tensor-parallel group and
the ranks with the same tensor-parallel index form a pipeline group:

    tp=2, pp=2      tp index 0   tp index 1
    stage 0         rank 0       rank 1        <- tensor-parallel group {0, 1}
    stage 1         rank 2       rank 3        <- tensor-parallel group {2, 3}
                    pipeline group {0, 2}, {1, 3}

One process holds one rank. Layers, runners and workers read the state they are built under
(`get_parallel_state`, a BuildScope) once, at construction, and keep it; outside `building_with` that is a world of
one (tp = pp = 1) where every collective is a no-op, so single-device code never touches
torch.distributed, and a single-device engine can live beside a distributed one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvforge.build_scope import BuildScope

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ParallelState:
    """Rank coordinates plus the groups: `tp_group` and `pp_group` carry tensors on the run device
    (NCCL/RCCL on GPUs, Gloo on the CPU); `cpu_group` carries pickled commands and results (Gloo)."""

    rank: int = 0
    tp_size: int = 1
    pp_size: int = 1
    tp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_rank(self, pp_rank: int) -> int:
        """The global rank with this process's tensor-parallel index in stage pp_rank."""
        return pp_rank * self.tp_size + self.tp_rank

    def layer_range(self, num_layers: int, pp_rank: int | None = None) -> tuple[int, int]:
        """[start, end) of the decoder layers this rank's stage (or stage pp_rank) runs: as even a split as possible."""
        if self.pp_size > num_layers:
            raise ValueError(f"pipeline_parallel_size={self.pp_size} exceeds the model's {num_layers} layers")
        stage = self.pp_rank if pp_rank is None else pp_rank
        return stage * num_layers // self.pp_size, (stage + 1) * num_layers // self.pp_size

    @property
    def sampler_rank(self) -> int:
        """The rank that samples and answers the driver: tensor index 0 of the last stage."""
        return (self.pp_size - 1) * self.tp_size


_WORLD_OF_ONE = ParallelState()
# The state a rank's model, runner and worker are built under (`building_with(state)`); a world of one outside.
PARALLEL = BuildScope("parallel state", lambda: _WORLD_OF_ONE)
get_parallel_state = PARALLEL.current
building_with = PARALLEL.building_with


def distributed_backend(device: torch.device) -> str:
    """NCCL on CUDA and ROCm (where torch maps it to RCCL), Gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_parallel_state(
    rank: int, tp_size: int, pp_size: int, init_method: str, device: torch.device,
    timeout: timedelta = timedelta(minutes=10),
) -> ParallelState:
    """Join the world of tp_size x pp_size ranks at init_method and build this rank's groups."""
    world_size = tp_size * pp_size
    backend = distributed_backend(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    # NOTE: new_group is collective: every rank creates every group, in the same order.
    tp_group = pp_group = None
    for stage in range(pp_size):
        group = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)), backend=backend)
        if rank // tp_size == stage:
            tp_group = group
    for index in range(tp_size):
        group = dist.new_group(list(range(index, world_size, tp_size)), backend=backend)
        if rank % tp_size == index:
            pp_group = group
    cpu_group = dist.new_group(list(range(world_size)), backend="gloo") if backend != "gloo" else dist.group.WORLD
    state = ParallelState(rank, tp_size, pp_size, tp_group, pp_group, cpu_group)
    logger.info("rank %d of %d joined (%s): tensor-parallel index %d, pipeline stage %d",
                rank, world_size, backend, state.tp_rank, state.pp_rank)
    return state


def leave_world() -> None:
    """Leave the distributed world, if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()
