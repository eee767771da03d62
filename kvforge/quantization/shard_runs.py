"""A merged layer (q, k, v; gate, up) whose checkpoint shards are stored in different widths: one weight-only kernel
per run of shards of the same bits and group size, each multiplying its rows of the layer.

A GGUF Q4_K_M file stores attn_v of about half the layers as Q6_K (6-bit codes in groups of 16) beside Q4_K q and k
(4-bit codes in groups of 32). One kernel over the three shards would take them all in the widest codes and the
narrowest groups, reading more bytes than the file holds; a kernel per run reads each shard in its own type:

    x -> [kernel(q, k) | kernel(v)] -> y [M, N_q + N_k + N_v]     (each run's kernel chosen by select_kernel)

`select_merged_kernel` is what a weight-only format calls for its QuantizedWeight or RowShards: a layer whose shards
form one run gets that one kernel, as before.
"""

from __future__ import annotations

import torch
from torch import nn

from kvforge.kernels.ops import OpTable
from kvforge.layers.linear_kernel import KernelModule, WeightArena
from kvforge.quantization.quantized_weight import QuantizedWeight, RowShards
from kvforge.quantization.weight_only_kernels import WeightOnlyKernel, select_kernel


class ShardRunsKernel(KernelModule):
    """The kernels of a merged layer's runs of shards, in row order, prepared (select_merged_kernel); the layer's bias
    is added once, after them. weight_bytes and flops are the runs' own (KernelModule's: every tensor of the kernels,
    each once)."""

    def __init__(self, kernels: list[WeightOnlyKernel]) -> None:
        super().__init__()
        self.runs = nn.ModuleList(kernels)
        self.name = "+".join(kernel.name for kernel in kernels)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return self.biased(torch.cat([kernel.apply(x) for kernel in self.runs], dim=-1))


def select_merged_kernel(weight: QuantizedWeight | RowShards, device: torch.device, dtype: torch.dtype, ops: OpTable,
                         arena: WeightArena | None = None,
                         bias: nn.Parameter | None = None) -> WeightOnlyKernel | ShardRunsKernel:
    """select_kernel's kernel for weight, unless it is RowShards of more than one run of bits and group size: then a
    ShardRunsKernel of one kernel per run (placed in arena in row order), adding bias."""
    runs = weight.runs() if isinstance(weight, RowShards) else [weight]
    if len(runs) == 1:
        return select_kernel(weight, device, dtype, ops, arena=arena, bias=bias)
    kernel = ShardRunsKernel([select_kernel(run, device, dtype, ops, arena=arena) for run in runs])
    shards = weight.shards
    kernel.bind(sum(shard.codes.shape[0] for shard in shards), shards[0].codes.shape[1], bias)
    return kernel.to(device)
