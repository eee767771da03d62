"""GPT-OSS's mixture of experts on MXFP4 expert weights (kernels/mxfp4.py): every routed (token, expert) pair through

    gate_up = w13[e] @ x + b13[e]                       w13 [E, 2 * inter, hidden], gate and up rows interleaved
    gate, up = gate_up[0::2].clamp(max=limit), gate_up[1::2].clamp(-limit, limit)
    act = (up + 1) * gate * sigmoid(alpha * gate)       the clamped SwiGLU (alpha 1.702, limit 7.0)
    out[t] += weight * (w2[e] @ act + b2[e])            w2 [E, hidden, inter]

Three implementations with one contract, the weights in MXFP4 (blocks and scales) throughout:

    mxfp4_moe_ref     every expert's weights dequantized whole, then the float math one expert at a time (fp32)
    mxfp4_moe_cpu     no float copy of all experts: each expert hit by the step is dequantized (w13 and w2,
                      3 * inter * hidden values) when its turn comes, then dropped. Cost per step and layer: one
                      dequantization per distinct expert hit plus the float GEMMs, and a float working set of one
                      expert. Under torch.compile (a decode step of a few tokens) each pair's weights are gathered
                      and dequantized instead (top_k * num_tokens experts' worth), which has no data-dependent shape.
    mxfp4_moe_triton  a grouped GEMM (pairs sorted by expert, as fused_moe) whose B operand is decoded from the
                      MXFP4 codes and scales in registers, tile by tile, with the bias added in the epilogue

The float weights of a bf16/fp32 GPT-OSS checkpoint take the same math (biased_moe over float weights).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvforge.kernels.grouped_gemm import block_pairs, store_pairs
from kvforge.kernels.moe_align import moe_align
from kvforge.kernels.mxfp4 import BLOCK_SIZE, check_mxfp4, dequantize_mxfp4
from kvforge.kernels.triton_compat import INTERPRETED, cdiv, jit, require_triton, tl
from kvforge.kernels.tuning import gemm_tiles
from kvforge.kernels.validation import FLOAT_DTYPES, INDEX_DTYPES, check_tensor
from kvforge.platforms import Platform

# The experts' float weights for some expert ids: ids [n] -> (w13 [n, 2 * inter, hidden], w2 [n, hidden, inter])
ExpertWeights = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[..., 2 * inter] with gate and up interleaved -> (up + 1) * glu(gate), both clamped: [..., inter]."""
    gate = gate_up[..., 0::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def biased_moe(
    hidden: torch.Tensor, weights_of: ExpertWeights, num_experts: int, w13_bias: torch.Tensor, w2_bias: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, alpha: float, limit: float,
) -> torch.Tensor:  # fmt: skip
    """The module docstring's math in fp32, one expert at a time (only the experts some pair goes to are read);
    under torch.compile, each pair's weights gathered. hidden: [num_tokens, hidden] -> [num_tokens, hidden]."""
    if torch.compiler.is_dynamo_compiling():
        return _gathered(hidden, weights_of, w13_bias, w2_bias, topk_weights, topk_ids, alpha, limit)
    x = hidden.float()
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in topk_ids.unique().tolist():
        if not 0 <= expert < num_experts:
            continue
        tokens, slots = (topk_ids == expert).nonzero(as_tuple=True)
        w13, w2 = (w[0].float() for w in weights_of(torch.tensor([expert], device=hidden.device)))
        act = swiglu_oai(F.linear(x[tokens], w13, w13_bias[expert].float()), alpha, limit)
        down = F.linear(act, w2, w2_bias[expert].float()) * topk_weights[tokens, slots, None].float()
        out.index_add_(0, tokens, down)
    return out.to(hidden.dtype)


def _gathered(
    hidden: torch.Tensor, weights_of: ExpertWeights, w13_bias: torch.Tensor, w2_bias: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, alpha: float, limit: float,
) -> torch.Tensor:  # fmt: skip
    """biased_moe with each pair's expert weights gathered: no data-dependent shapes (a compiled decode step)."""
    ids = topk_ids.long().clamp(min=0)
    pair_weights = topk_weights.float() * (topk_ids >= 0)  # [T, k]
    w13, w2 = weights_of(ids.reshape(-1))
    w13 = w13.float().view(*ids.shape, *w13.shape[1:])  # [T, k, 2 * inter, hidden]
    w2 = w2.float().view(*ids.shape, *w2.shape[1:])  # [T, k, hidden, inter]
    gate_up = torch.einsum("th,tkih->tki", hidden.float(), w13) + w13_bias[ids].float()
    down = torch.einsum("tki,tkhi->tkh", swiglu_oai(gate_up, alpha, limit), w2) + w2_bias[ids].float()
    return (down * pair_weights[..., None]).sum(dim=1).to(hidden.dtype)


def mxfp4_experts(w13_blocks: torch.Tensor, w13_scales: torch.Tensor, w2_blocks: torch.Tensor,
                  w2_scales: torch.Tensor) -> ExpertWeights:  # fmt: skip
    """The float weights of some experts, dequantized from their MXFP4 blocks and scales when asked."""
    return lambda ids: (dequantize_mxfp4(w13_blocks[ids], w13_scales[ids]),
                        dequantize_mxfp4(w2_blocks[ids], w2_scales[ids]))  # fmt: skip


def mxfp4_moe_ref(
    hidden: torch.Tensor, w13_blocks: torch.Tensor, w13_scales: torch.Tensor, w13_bias: torch.Tensor,
    w2_blocks: torch.Tensor, w2_scales: torch.Tensor, w2_bias: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, alpha: float, limit: float,
) -> torch.Tensor:  # fmt: skip
    """The readable reference: every expert dequantized whole (a float copy of all experts), then biased_moe."""
    w13, w2 = dequantize_mxfp4(w13_blocks, w13_scales), dequantize_mxfp4(w2_blocks, w2_scales)
    return biased_moe(hidden, lambda ids: (w13[ids], w2[ids]), w13.shape[0], w13_bias, w2_bias, topk_weights,
                      topk_ids, alpha, limit)  # fmt: skip


def mxfp4_moe_cpu(
    hidden: torch.Tensor, w13_blocks: torch.Tensor, w13_scales: torch.Tensor, w13_bias: torch.Tensor,
    w2_blocks: torch.Tensor, w2_scales: torch.Tensor, w2_bias: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, alpha: float, limit: float,
) -> torch.Tensor:  # fmt: skip
    """mxfp4_moe_ref without the float copy of all experts: each expert is dequantized as its turn comes."""
    weights_of = mxfp4_experts(w13_blocks, w13_scales, w2_blocks, w2_scales)
    return biased_moe(hidden, weights_of, w13_blocks.shape[0], w13_bias, w2_bias, topk_weights, topk_ids, alpha,
                      limit)  # fmt: skip


@jit
def _mxfp4_grouped_gemm_kernel(
    out_ptr, a_ptr, blocks_ptr, scales_ptr, bias_ptr, pair_weights_ptr, sorted_pair_ids_ptr, block_expert_ids_ptr,
    num_pairs, n_size, k_size, stride_am, stride_om,
    PAIRS_PER_A_ROW: tl.constexpr, APPLY_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """Grid (row blocks, column blocks). For the BLOCK_M sorted pairs of one block, all of one expert e:
    out[pair, cols] = (a[pair // PAIRS_PER_A_ROW] @ W[e, cols, :]^T + bias[e, cols]) (* pair_weights[pair]),
    W decoded from blocks [E, N, K / 2] bytes and scales [E, N, K / 32] (contiguous) into a's dtype (every MXFP4
    value is exact in bf16 and fp16 but for scales past their range), or fp32 with DOT_FP32; fp32 accumulation."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ids_ptr + block)
    if expert < 0:
        return
    pair_ids, row_mask, a_rows, cols, col_mask = block_pairs(sorted_pair_ids_ptr, block, num_pairs, n_size,
                                                             PAIRS_PER_A_ROW, BLOCK_M, BLOCK_N)
    rows_of_expert = expert.to(tl.int64) * n_size + cols[None, :].to(tl.int64)  # [1, BLOCK_N] weight rows
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, k_size, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_mask = ks < k_size
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        b_mask = k_mask[:, None] & col_mask[None, :]
        byte = tl.load(blocks_ptr + rows_of_expert * (k_size // 2) + ks[:, None] // 2, mask=b_mask, other=0)
        code = (byte.to(tl.int32) >> ((ks[:, None] % 2) * 4)) & 0x0F  # [BLOCK_K, BLOCK_N]: low nibble first
        exponent = (code >> 1) & 3
        mantissa = (code & 1).to(tl.float32)
        normal = (1.0 + mantissa * 0.5) * tl.exp2((exponent - 1).to(tl.float32))
        magnitude = tl.where(exponent == 0, mantissa * 0.5, normal)
        scale = tl.load(scales_ptr + rows_of_expert * (k_size // 32) + ks[:, None] // 32, mask=b_mask, other=0)
        b = tl.where(code >= 8, -magnitude, magnitude) * tl.exp2(scale.to(tl.float32) - 127.0)
        if DOT_FP32:
            acc = tl.dot(a.to(tl.float32), b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b.to(a.dtype), acc)
    acc += tl.load(bias_ptr + expert.to(tl.int64) * n_size + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    store_pairs(out_ptr, acc, pair_weights_ptr, pair_ids, row_mask, cols, col_mask, stride_om, APPLY_WEIGHT)


def _check_inputs(hidden: torch.Tensor, w13_blocks: torch.Tensor, w13_scales: torch.Tensor, w13_bias: torch.Tensor,
                  w2_blocks: torch.Tensor, w2_scales: torch.Tensor, w2_bias: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:  # fmt: skip
    check_tensor("hidden", hidden, shape=(None, None), dtypes=FLOAT_DTYPES)
    num_tokens, hidden_size = hidden.shape
    check_mxfp4(w13_blocks, w13_scales)
    check_mxfp4(w2_blocks, w2_scales)
    num_experts, two_inter = w13_blocks.shape[:2]
    if w13_blocks.shape[2] * BLOCK_SIZE != hidden_size or two_inter % 2:
        raise ValueError(
            f"w13_blocks must be [experts, 2 * inter, hidden / 32, 16] with hidden {hidden_size}, got "
            f"{tuple(w13_blocks.shape)}"
        )
    if tuple(w2_blocks.shape[:3]) != (num_experts, hidden_size, two_inter // 2 // BLOCK_SIZE):
        raise ValueError(
            f"w2_blocks must be [{num_experts}, {hidden_size}, inter / 32, 16], got {tuple(w2_blocks.shape)}"
        )
    check_tensor("w13_bias", w13_bias, shape=(num_experts, two_inter), dtypes=FLOAT_DTYPES)
    check_tensor("w2_bias", w2_bias, shape=(num_experts, hidden_size), dtypes=FLOAT_DTYPES)
    check_tensor("topk_ids", topk_ids, shape=(num_tokens, None), dtypes=INDEX_DTYPES)
    check_tensor("topk_weights", topk_weights, shape=tuple(topk_ids.shape), dtypes=FLOAT_DTYPES)
    tensors = (hidden, w13_blocks, w13_scales, w13_bias, w2_blocks, w2_scales, w2_bias)
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("hidden and the experts' blocks, scales and biases must be contiguous")


def mxfp4_moe_triton(
    hidden: torch.Tensor, w13_blocks: torch.Tensor, w13_scales: torch.Tensor, w13_bias: torch.Tensor,
    w2_blocks: torch.Tensor, w2_scales: torch.Tensor, w2_bias: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, alpha: float, limit: float, *, platform: Platform | None = None,
) -> torch.Tensor:  # fmt: skip
    """mxfp4_moe_ref in Triton, with no host sync: moe_align, the MXFP4 grouped GEMM with w13 (+ bias), the clamped
    SwiGLU, the MXFP4 grouped GEMM with w2 (+ bias, times the routing weight), the sum of each token's pairs.
    platform: whose GEMM tiles (None: the current platform's)."""
    require_triton()
    _check_inputs(hidden, w13_blocks, w13_scales, w13_bias, w2_blocks, w2_scales, w2_bias, topk_weights, topk_ids)
    (num_tokens, hidden_size), (num_experts, two_inter), top_k = hidden.shape, w13_blocks.shape[:2], topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(hidden)
    tiles = gemm_tiles(cdiv(num_pairs, num_experts), platform)  # rows per expert on an even routing
    sorted_pair_ids, block_expert_ids = moe_align(topk_ids, num_experts, tiles.block_m)

    def grouped_gemm(out: torch.Tensor, a: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                     bias: torch.Tensor, pair_weights: torch.Tensor | None, pairs_per_a_row: int) -> None:  # fmt: skip
        n_size = blocks.shape[1]
        grid = (block_expert_ids.shape[0], cdiv(n_size, tiles.block_n))
        _mxfp4_grouped_gemm_kernel[grid](
            out, a, blocks, scales, bias, out if pair_weights is None else pair_weights, sorted_pair_ids,
            block_expert_ids, num_pairs, n_size, a.shape[1], a.stride(0), out.stride(0),
            PAIRS_PER_A_ROW=pairs_per_a_row, APPLY_WEIGHT=pair_weights is not None,
            BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
            DOT_FP32=a.dtype == torch.float32 or (INTERPRETED and a.dtype == torch.bfloat16),  # interpreter: bf16 dots
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )  # fmt: skip

    # NOTE: zeroed: rows of pairs routed to no local expert are never written, then still activated
    gate_up = torch.zeros((num_pairs, two_inter), dtype=torch.float32, device=hidden.device)
    grouped_gemm(gate_up, hidden, w13_blocks, w13_scales, w13_bias, None, top_k)
    act = swiglu_oai(gate_up, alpha, limit).to(hidden.dtype)  # [num_pairs, inter], rounded as the GEMM reads it
    down = torch.zeros((num_pairs, hidden_size), dtype=torch.float32, device=hidden.device)
    grouped_gemm(down, act, w2_blocks, w2_scales, w2_bias, topk_weights.reshape(-1).float(), 1)
    return down.view(num_tokens, top_k, hidden_size).sum(1).to(hidden.dtype)


__all__ = ["biased_moe", "mxfp4_experts", "mxfp4_moe_cpu", "mxfp4_moe_ref", "mxfp4_moe_triton", "swiglu_oai"]
