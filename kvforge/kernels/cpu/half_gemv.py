"""Linear layers whose weight is kept in 16 bits (a GGUF file's F16 and BF16 matrices): float32 activations times a
float16 or bfloat16 weight [N, K], with no float32 copy of the weight at any time.

    CPU, up to HALF_GEMV_MAX_TOKENS rows of x   the C++ GEMV of csrc/half_gemv.cpp: the 16-bit weight streamed and
                                                widened in registers (AVX-512 or AVX2 + F16C), float32 sums
    CPU, more rows, a bfloat16 weight on a CPU  torch's bfloat16 GEMM (oneDNN: AVX-512 BF16 or AMX), x rounded to
    that multiplies bfloat16 (AVX-512 BF16)     bfloat16 as llama.cpp rounds it for its BF16 dot products
    CPU, more rows, otherwise                   the weight widened WIDEN_ROWS rows at a time into a float32 block
                                                that stays in cache, each block multiplied by torch's float32 GEMM
                                                (oneDNN / BLAS): the widening is paid once per call, over all rows
    other devices                               F.linear in the weight's type (x rounded to it), the weight as is

The GEMV and the widened GEMM keep x and the sums in float32 and widen the weight exactly, so they equal F.linear on
the widened weight up to the order of the sums; the bfloat16 GEMM differs by x's rounding (about 2e-3 of a layer's
output).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

HALF_DTYPES = (torch.float16, torch.bfloat16)
# NOTE: untimed guesses, to be measured (python -m kvforge.benchmarks.quant_gemv_cpu has the float32 ones): the
# GEMV reads half the bytes of the float32 one, so it should stay ahead of the widened GEMM past the float32
# GEMV's 4 rows; a block of 256 rows of K = 2048 is 2 MiB of float32.
HALF_GEMV_MAX_TOKENS = 16
WIDEN_ROWS = 256
# NOTE: a bfloat16 weight [8192, 2048] on the Xeon VM of benchmarks/RESULTS.md (2 threads, AVX-512 BF16, AMX), ms of
# the GEMV / oneDNN's bfloat16 GEMM / the widened GEMM: 4 rows 1.3 / 1.7 / -, 8 rows 3.6 / 2.0 / -, 16 rows 4.7 / 2.0
# / -, 64 rows - / 9.6 / 74.7, 512 rows - / 26.9 / 226 (torch widens bfloat16 slowly). A float16 weight's GEMM was
# 1.6-1.9x the widened one at 64-512 rows but slower at 16-32, and F16 files meet their targets: they stay exact.
BF16_GEMV_MAX_TOKENS = 4


@functools.cache
def native_bf16_gemm() -> bool:
    """The CPU multiplies bfloat16 in hardware (AVX-512 BF16), which oneDNN's bfloat16 GEMM uses."""
    return torch.backends.mkldnn.is_available() and torch.cpu._is_avx512_bf16_supported()


def half_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemv: bool) -> torch.Tensor:
    """F.linear(x, weight.to(x.dtype), bias) in x's dtype, for a weight [N, K] kept in float16 or bfloat16, without
    widening the whole weight. gemv: the vectorized build of the CPU kernels is loaded (decided at load)."""
    if weight.device.type != "cpu":
        return F.linear(x.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype)).to(x.dtype)
    rows = x.reshape(-1, x.shape[-1]).float()  # [num_tokens, K]
    native = weight.dtype == torch.bfloat16 and native_bf16_gemm()
    if gemv and rows.shape[0] <= (BF16_GEMV_MAX_TOKENS if native else HALF_GEMV_MAX_TOKENS):
        out = torch.ops.kvforge_cpu.half_gemv(rows, weight)
    elif native:
        out = F.linear(rows.to(torch.bfloat16), weight).float()
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
