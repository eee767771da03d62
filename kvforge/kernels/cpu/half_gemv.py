"""Linear layers whose weight is kept in 16 bits (a GGUF file's F16 and BF16 matrices): float32 activations times a
float16 or bfloat16 weight [N, K], with no float32 copy of the weight at any time.

    CPU, up to HALF_GEMV_MAX_TOKENS rows of x   the C++ GEMV of csrc/half_gemv.cpp: the 16-bit weight streamed and
                                                widened in registers (AVX-512 or AVX2 + F16C), float32 sums
    CPU, more rows (prompts, large batches)     the weight widened WIDEN_ROWS rows at a time into a float32 block
                                                that stays in cache, each block multiplied by torch's float32 GEMM
                                                (oneDNN / BLAS): the widening is paid once per call, over all rows
    other devices                               F.linear in the weight's type (x rounded to it), the weight as is

Both CPU paths keep x and the sums in float32 and widen the weight exactly, so they equal F.linear on the widened
weight up to the order of the sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

HALF_DTYPES = (torch.float16, torch.bfloat16)
# NOTE: untimed guesses, to be measured (python -m kvforge.benchmarks.quant_gemv_cpu has the float32 ones): the
# GEMV reads half the bytes of the float32 one, so it should stay ahead of the widened GEMM past the float32
# GEMV's 4 rows; a block of 256 rows of K = 2048 is 2 MiB of float32.
HALF_GEMV_MAX_TOKENS = 16
WIDEN_ROWS = 256


def half_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemv: bool) -> torch.Tensor:
    """F.linear(x, weight.to(x.dtype), bias) in x's dtype, for a weight [N, K] kept in float16 or bfloat16, without
    widening the whole weight. gemv: the vectorized build of the CPU kernels is loaded (decided at load)."""
    if weight.device.type != "cpu":
        return F.linear(x.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype)).to(x.dtype)
    rows = x.reshape(-1, x.shape[-1]).float()  # [num_tokens, K]
    if gemv and rows.shape[0] <= HALF_GEMV_MAX_TOKENS:
        out = torch.ops.kvforge_cpu.half_gemv(rows, weight)
    else:
        out = widened_linear(rows, weight)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)


def widened_linear(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows [M, K] float32 times the 16-bit weight [N, K]: WIDEN_ROWS weight rows widened to float32 at a time."""
    blocks = [F.linear(rows, weight[start : start + WIDEN_ROWS].float())
              for start in range(0, weight.shape[0], WIDEN_ROWS)]
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)
