"""A quantized weight matrix, whatever format it came from, and round-to-nearest quantization.

    W[n, perm[k]] ~= (codes[n, k] - zeros[n, k // group_size]) * scales[n, k // group_size]

perm is None except for GPTQ act-order, whose groups gather input features by decreasing Hessian
diagonal: sorting the columns by group makes every group contiguous again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.kernels.quant_gemm import dequantize_ref, pack_codes


@dataclass(slots=True)
class QuantizedWeight:
    codes: torch.Tensor  # [N, K] uint8, in [0, 2**bits)
    scales: torch.Tensor  # [N, G] float32
    zeros: torch.Tensor  # [N, G] float32, zero points in code units (integers, but GGUF Q4_1's are not)
    bits: int  # 4, 8, 5 or 6 (GGUF's 5- and 6-bit types; kernels without their layout take them as 8-bit codes)
    perm: torch.Tensor | None = None  # [K] int64: column k of codes is input feature perm[k]

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    def widened(self) -> QuantizedWeight:
        """The same weight with 5- or 6-bit codes as 8-bit ones (the same codes and zero points)."""
        return QuantizedWeight(self.codes, self.scales, self.zeros, 8 if self.bits in (5, 6) else self.bits, self.perm)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K], input features in their original order."""
        bits = self.widened().bits
        weight = dequantize_ref(pack_codes(self.codes, bits), self.scales.float(), self.zeros.float(), bits)
        if self.perm is None:
            return weight
        restored = torch.empty_like(weight)
        restored[:, self.perm] = weight
        return restored

    def g_idx(self) -> torch.Tensor:
        """GPTQ's g_idx: the group of each input feature, in original order. [K] int32."""
        in_features = self.codes.shape[1]
        groups = torch.arange(in_features, dtype=torch.int32) // self.group_size
        if self.perm is None:
            return groups
        g_idx = torch.empty_like(groups)
        g_idx[self.perm] = groups
        return g_idx


@dataclass(slots=True)
class RowShards:
    """A merged layer's weight as the checkpoint's shards (q, k, v; gate, up), its rows stacked in order without a
    copy into one tensor: each shard's codes [N_s, K] of at most `bits` bits, its scales and zeros in groups of a
    multiple of group_size columns."""

    shards: list[QuantizedWeight]
    bits: int
    group_size: int

    def outline(self) -> QuantizedWeight:
        """The stacked weight's shapes, bits and groups, on the meta device (what a kernel's `fits` reads)."""
        rows, in_features = sum(shard.codes.shape[0] for shard in self.shards), self.shards[0].codes.shape[1]
        groups = (rows, in_features // self.group_size)
        return QuantizedWeight(torch.empty(rows, in_features, dtype=torch.uint8, device="meta"),
                               torch.empty(groups, dtype=torch.float32, device="meta"),
                               torch.empty(groups, dtype=torch.float32, device="meta"), self.bits)

    def runs(self) -> list[QuantizedWeight | RowShards]:
        """The shards in runs of the same bits and group size, in order: a run of one shard as its QuantizedWeight,
        a longer one as RowShards of its own bits and groups (a merged layer's kernel per run, quantization/
        shard_runs.py, reads each shard in its own width rather than the widest one's)."""
        runs: list[list[QuantizedWeight]] = []
        for shard in self.shards:
            if runs and (runs[-1][0].bits, runs[-1][0].group_size) == (shard.bits, shard.group_size):
                runs[-1].append(shard)
            else:
                runs.append([shard])
        return [run[0] if len(run) == 1 else RowShards(run, run[0].bits, run[0].group_size) for run in runs]

    def stacked(self) -> QuantizedWeight:
        """The one QuantizedWeight [sum N_s, K] in groups of group_size (a copy)."""
        def stack(name: str) -> torch.Tensor:
            return torch.cat([getattr(shard, name).repeat_interleave(shard.group_size // self.group_size, dim=1)
                              for shard in self.shards])

        return QuantizedWeight(torch.cat([shard.codes for shard in self.shards]), stack("scales"), stack("zeros"),
                               self.bits)


def group_params(weight: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and zero points [N] that map the rows of weight [N, g] onto [0, 2**bits - 1].

    NOTE: scales are rounded to float16 before they are used, so that a checkpoint storing them in
    float16 (as GPTQ and AWQ do) holds exactly the weights the codes were chosen for."""
    max_code = 2**bits - 1
    w_min = weight.amin(dim=1).clamp(max=0)
    w_max = weight.amax(dim=1).clamp(min=0)
    if sym:
        w_max = torch.maximum(w_min.abs(), w_max)
        w_min = -w_max
    scales = ((w_max - w_min) / max_code).clamp(min=1e-6).half().float()
    if sym:
        zeros = torch.full_like(scales, (max_code + 1) // 2)
    else:
        # NOTE: zero point >= 1, because GPTQ's v1 format stores zero - 1 in `bits` bits.
        zeros = torch.round(-w_min / scales).clamp(1, max_code)
    return scales, zeros


def quantize_codes(
    weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int
) -> torch.Tensor:
    """weight [N, g], scales/zeros [N] -> codes [N, g] (float, integral values)."""
    return torch.clamp(torch.round(weight / scales[:, None]) + zeros[:, None], 0, 2**bits - 1)


def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int, sym: bool) -> QuantizedWeight:
    """Round-to-nearest, group by group. weight: [N, K] float; group_size -1 means one group per row."""
    num_rows, in_features = weight.shape
    group_size = in_features if group_size == -1 else group_size
    if in_features % group_size:
        raise ValueError(f"input width {in_features} is not a multiple of group_size {group_size}")
    groups = weight.float().reshape(num_rows, -1, group_size).transpose(0, 1)  # [G, N, g]
    codes, scales, zeros = [], [], []
    for group in groups:
        scale, zero = group_params(group, bits, sym)
        codes.append(quantize_codes(group, scale, zero, bits))
        scales.append(scale)
        zeros.append(zero)
    return QuantizedWeight(
        torch.cat(codes, dim=1).to(torch.uint8), torch.stack(scales, dim=1), torch.stack(zeros, dim=1), bits
    )
