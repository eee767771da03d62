"""Batched LoRA: each token row adds the low-rank update of its own adapter, in two products.

    shrink   h[t] = x[t] @ A[slot[t]]^T          x [T, K], A [slots, R, K]  ->  h [T, R]
    expand   y[t] += h[t] @ B[slot[t]]^T         B [slots, N, R]            ->  y [T, N]

slot[t] = -1: the row has no adapter (h and the update are zero). Ranks below R are zero-padded in A and B, and
an adapter's scaling (alpha / r) is folded into its B when it is written to its slot (lora/pool.py). A and B may be
of another float dtype than x (the engine's lora_dtype: 16-bit adapters under a float32 model, say): every
implementation widens them as it reads them and sums in float32 (the torch path converts them to x's dtype first).

Three implementations of each product, one contract:
    reference   gather each row's adapter, then one batched GEMV (the BGMV shape): readable, memory T x R x K
    torch       one GEMM against every slot at once, the rows of other slots masked: no gather, traces
                into the compiled decode step; its cost grows with the number of slots (where the C++ CPU kernels
                are not built)
    Triton      per row (BGMV): one program per (row, output block) reads its row's slot and multiplies that
                adapter only; segmented (SGMV), for steps of many rows (tuning.lora_segmented): the rows grouped
                by slot (moe_align, as fused MoE groups pairs by expert), each program multiplies BLOCK_M rows of
                one adapter with tl.dot (kernels/grouped_gemm.py), reading the adapter once per block of rows

On the CPU with its C++ kernels, a LoRA layer's whole update is one op instead (kernels/cpu/lora.py): the shrink of
every checkpoint matrix of a merged layer (q/k/v, gate/up) and each matrix's expand, the rows grouped by slot, added
into the base projection's output in place. Its weights are kept transposed, A^T [slots, K, fused_width(M * R)] (the
columns past M * R zero) and B^T [slots, R, N] per matrix:

    fused    y[t, cols of m] += (x[t] @ AT[slot[t]][:, m * R : (m + 1) * R]) @ BT_m[slot[t]]    (lora_fused_ref)
"""

from __future__ import annotations

import torch

from kvforge.kernels.grouped_gemm import launch_grouped_gemm
from kvforge.kernels.moe_align import moe_align
from kvforge.kernels.triton_compat import cdiv, jit, next_power_of_2, require_triton, tl
from kvforge.kernels.tuning import GemmTiles, gemm_tiles, lora_segmented
from kvforge.kernels.validation import FLOAT_DTYPES, INDEX_DTYPES, check_same_device, check_tensor
from kvforge.platforms import Platform


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [T, K], a [S, R, K], slots [T] (-1: none) -> h [T, R] in x's dtype (fp32 accumulation)."""
    picked = a[slots.clamp(min=0)].float()  # [T, R, K]
    h = torch.einsum("tk,trk->tr", x.float(), picked)
    return (h * (slots >= 0).unsqueeze(1)).to(x.dtype)


def lora_expand_ref(h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """h [T, R], b [S, N, R], slots [T], y [T, N] -> y + h @ b[slot]^T (rows of slot -1 unchanged)."""
    picked = b[slots.clamp(min=0)].float()  # [T, N, R]
    delta = torch.einsum("tr,tnr->tn", h.float(), picked) * (slots >= 0).unsqueeze(1)
    return (y.float() + delta).to(y.dtype)


FUSED_VECTOR = 16  # floats per vector of the fused op's shrink, which A^T's columns fill


def fused_width(width: int) -> int:
    """The columns of the fused op's A^T for M * R = width: whole vectors."""
    return -(-width // FUSED_VECTOR) * FUSED_VECTOR


def lora_fused_ref(x: torch.Tensor, y: torch.Tensor, at: torch.Tensor, bt: list[torch.Tensor],
                   slots: torch.Tensor) -> torch.Tensor:
    """x [T, K], y [T, N], at: A^T [S, K, fused_width(M * R)], bt: M matrices' B^T [S, R, N_m] (sum N_m = N), slots
    [T] -> y with each row's update added (in place, and returned)."""
    rank = bt[0].shape[1]
    h = lora_shrink_ref(x, at[:, :, : len(bt) * rank].transpose(1, 2), slots)  # [T, M * R]
    offset = 0
    for m, b in enumerate(bt):
        cols = y[:, offset : offset + b.shape[2]]
        cols.copy_(lora_expand_ref(h[:, m * rank : (m + 1) * rank], b.transpose(1, 2), slots, cols))
        offset += b.shape[2]
    return y


def _one_hot(slots: torch.Tensor, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, S]: 1 at each row's slot, all zeros for slot -1."""
    return (slots.unsqueeze(1) == torch.arange(num_slots, device=slots.device)).to(dtype)


def lora_shrink_cpu(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """lora_shrink_ref as one GEMM over every slot, then each row keeps its slot's R columns."""
    num_slots, rank, _ = a.shape
    every = (x @ a.reshape(num_slots * rank, -1).t().to(x.dtype)).view(-1, num_slots, rank)  # [T, S, R]
    return (every * _one_hot(slots, num_slots, x.dtype).unsqueeze(2)).sum(1)


def lora_expand_cpu(h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """lora_expand_ref as one GEMM: h spread into its slot's R columns of [T, S * R], the others zero."""
    num_slots, num_out, rank = b.shape
    spread = (h.unsqueeze(1) * _one_hot(slots, num_slots, h.dtype).unsqueeze(2)).reshape(-1, num_slots * rank)
    return y + spread @ b.permute(0, 2, 1).reshape(num_slots * rank, num_out).to(h.dtype)


@jit
def _lora_shrink_kernel(h_ptr, x_ptr, a_ptr, slots_ptr, rank, dim, stride_x, stride_as, stride_ar,
                        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (rows, rank blocks): h[row, r] = sum_k x[row, k] * a[slot, r, k], fp32 accumulation."""
    row = tl.program_id(0).to(tl.int64)
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    keep = (slot >= 0).to(tl.float32)  # a row of slot -1 reads slot 0 and keeps none of it
    adapter = a_ptr + tl.maximum(slot, 0) * stride_as
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for start in range(0, dim, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < dim, other=0.0).to(tl.float32)
        tile_mask = (ranks[:, None] < rank) & (cols[None, :] < dim)
        a = tl.load(adapter + ranks[:, None] * stride_ar + cols[None, :], mask=tile_mask, other=0.0)
        acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    tl.store(h_ptr + row * rank + ranks, (acc * keep).to(h_ptr.dtype.element_ty), mask=ranks < rank)


@jit
def _lora_expand_kernel(out_ptr, h_ptr, b_ptr, slots_ptr, y_ptr, rank, num_out, stride_y, stride_bs, stride_bn,
                        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """Grid (rows, output blocks): out[row, n] = y[row, n] + sum_r h[row, r] * b[slot, n, r]."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    keep = (slot >= 0).to(tl.float32)
    adapter = b_ptr + tl.maximum(slot, 0) * stride_bs
    delta = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, rank, BLOCK_R):
        ranks = start + tl.arange(0, BLOCK_R)
        h = tl.load(h_ptr + row * rank + ranks, mask=ranks < rank, other=0.0).to(tl.float32)
        tile_mask = (cols[:, None] < num_out) & (ranks[None, :] < rank)
        b = tl.load(adapter + cols[:, None] * stride_bn + ranks[None, :], mask=tile_mask, other=0.0)
        delta += tl.sum(b.to(tl.float32) * h[None, :], axis=1)
    y = tl.load(y_ptr + row * stride_y + cols, mask=cols < num_out, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * num_out + cols, (y + delta * keep).to(out_ptr.dtype.element_ty), mask=cols < num_out)


def _check_slots(slots: torch.Tensor, num_rows: int) -> None:
    check_tensor("slots", slots, shape=(num_rows,), dtypes=INDEX_DTYPES)


def _segments(slots: torch.Tensor, num_slots: int, platform: Platform | None
              ) -> tuple[torch.Tensor, torch.Tensor, GemmTiles]:
    """The rows grouped by slot into blocks of BLOCK_M rows of one slot (rows of slot -1 in none): (sorted row ids,
    each block's slot, platform's tiles)."""
    tiles = gemm_tiles(cdiv(slots.shape[0], num_slots), platform)  # rows per adapter when the rows spread evenly
    sorted_rows, block_slots = moe_align(slots.unsqueeze(1), num_slots, tiles.block_m)
    return sorted_rows, block_slots, tiles


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor,
                       segmented: bool | None = None, *, platform: Platform | None = None) -> torch.Tensor:
    """lora_shrink_ref in Triton; segmented: SGMV (True) or BGMV (False), None: by the number of rows; platform:
    whose threshold and tiles (None: the current platform's)."""
    require_triton()
    check_tensor("x", x, shape=(None, None), dtypes=FLOAT_DTYPES)
    num_rows, dim = x.shape
    check_tensor("a", a, shape=(None, None, dim), dtypes=FLOAT_DTYPES)
    _check_slots(slots, num_rows)
    check_same_device(x=x, a=a, slots=slots)
    rank = a.shape[1]
    if segmented if segmented is not None else lora_segmented(num_rows, platform):
        h = torch.zeros(num_rows, rank, dtype=x.dtype, device=x.device)  # rows of slot -1 are not written
        if num_rows and rank:
            sorted_rows, block_slots, tiles = _segments(slots, a.shape[0], platform)
            launch_grouped_gemm(h, x, a, None, sorted_rows, block_slots, 1, tiles)
        return h
    h = torch.empty(num_rows, rank, dtype=x.dtype, device=x.device)
    if num_rows == 0 or rank == 0:
        return h
    block_r = min(next_power_of_2(rank), 64)
    block_k = min(next_power_of_2(dim), 128)
    _lora_shrink_kernel[(num_rows, cdiv(rank, block_r))](
        h, x, a, slots, rank, dim, x.stride(0), a.stride(0), a.stride(1), BLOCK_R=block_r, BLOCK_K=block_k)
    return h


def lora_expand_triton(h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, y: torch.Tensor,
                       segmented: bool | None = None, *, platform: Platform | None = None) -> torch.Tensor:
    """lora_expand_ref in Triton (a new tensor: y is not written); segmented as for lora_shrink_triton."""
    require_triton()
    check_tensor("h", h, shape=(None, None), dtypes=FLOAT_DTYPES)
    num_rows, rank = h.shape
    check_tensor("y", y, shape=(num_rows, None), dtypes=FLOAT_DTYPES)
    num_out = y.shape[1]
    check_tensor("b", b, shape=(None, num_out, rank), dtypes=FLOAT_DTYPES)
    _check_slots(slots, num_rows)
    check_same_device(h=h, b=b, slots=slots, y=y)
    h = h.contiguous()
    if segmented if segmented is not None else lora_segmented(num_rows, platform):
        delta = torch.zeros(num_rows, num_out, dtype=torch.float32, device=y.device)  # slot -1: not written
        if num_rows and num_out and rank:
            sorted_rows, block_slots, tiles = _segments(slots, b.shape[0], platform)
            launch_grouped_gemm(delta, h, b, None, sorted_rows, block_slots, 1, tiles)
        return (y.float() + delta).to(y.dtype)
    out = torch.empty(num_rows, num_out, dtype=y.dtype, device=y.device)
    if num_rows == 0 or num_out == 0:
        return out
    block_n = min(next_power_of_2(num_out), 128)
    block_r = min(next_power_of_2(max(rank, 1)), 64)
    _lora_expand_kernel[(num_rows, cdiv(num_out, block_n))](
        out, h, b, slots, y, rank, num_out, y.stride(0), b.stride(0), b.stride(1), BLOCK_N=block_n, BLOCK_R=block_r)
    return out
