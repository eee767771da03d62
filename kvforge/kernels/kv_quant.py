"""Quantized KV cache entries: int8 or fp8 (e4m3) codes with one float32 scale per (token, KV head).

The cache write quantizes each head's row of head_dim values on its own, with a dynamic scale:

    x = key[token, head, :]     scale = absmax(x) / CODE_MAX       (0 for an all-zero row)
                                codes = round(x * CODE_MAX / absmax(x))
    read back:                  x ~= codes * scale                  |error| <= scale / 2 for int8

int8 rounds half up (floor(y + 0.5)) and clamps to [-127, 127], so the Triton kernels round exactly like
this reference; fp8 clamps to [-448, 448] and the cast rounds to nearest (e4m3fn has no infinity:
past 448 a cast gives NaN). On the AMD MI300 (gfx942), whose fp8 is the "fnuz" e4m3 (exponent bias 8, no
negative zero), fp8 codes are float8_e4m3fnuz, clamped to [-240, 240]. Codes and scales live in separate
paged tensors:

    codes   [num_blocks, block_size, num_kv_heads, head_dim]   int8, float8_e4m3fn or float8_e4m3fnuz
    scales  [num_blocks, block_size, num_kv_heads]             float32
"""

from __future__ import annotations

import torch

from kvforge.config import KV_CACHE_DTYPES
from kvforge.kernels.triton_compat import jit, tl
from kvforge.platforms import Platform, current_platform

CODE_MAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0}
CODE_DTYPES = tuple(CODE_MAX)
# The value of the fp8 code whose bits read 1.0 as e4m3fn: fnuz's exponent bias is one larger.
FP8_UNIT: dict[torch.dtype, float] = {torch.float8_e4m3fn: 1.0, torch.float8_e4m3fnuz: 0.5}
SCALE_DTYPE = torch.float32


def kv_code_dtype(kv_cache_dtype: str, platform: Platform | None = None) -> torch.dtype | None:
    """The code dtype of a --kv-cache-dtype value on platform (default: the current one); None for "auto" and
    the float types (the cache holds values). fp8 is e4m3fn, or e4m3fnuz on gfx942."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "int8":
        return torch.int8
    if kv_cache_dtype == "fp8":
        return (platform if platform is not None else current_platform()).fp8_dtype
    return None


def check_triton_code_dtype(code_dtype: torch.dtype, platform: Platform) -> None:
    """The Triton kernels read and write the GPU's own fp8 (Platform.fp8_dtype) where it is native, and
    either variant in the interpreter; elsewhere an fp8 cache is a ValueError that names the option. int8
    runs everywhere."""
    if code_dtype not in FP8_UNIT or not platform.is_gpu:  # int8 codes, or a cache in the model dtype
        return
    if not (platform.has_native_fp8 and code_dtype == platform.fp8_dtype):
        raise ValueError(
            f"kv_cache_dtype='fp8' ({code_dtype} codes) needs an NVIDIA sm_89+ or AMD gfx942/gfx950 GPU for the "
            f"Triton kernels; this one is {platform.arch}: use --kv-cache-dtype int8"
        )


def quantize_kv(x: torch.Tensor, code_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., head_dim] -> (codes [..., head_dim] of code_dtype, scales [...] float32)."""
    code_max = CODE_MAX[code_dtype]
    x = x.float()
    absmax = x.abs().amax(dim=-1)
    inv_scale = torch.where(absmax > 0, code_max / absmax.clamp_min(1e-30), torch.zeros_like(absmax))
    y = (x * inv_scale[..., None]).clamp(-code_max, code_max)
    if code_dtype == torch.int8:
        y = torch.floor(y + 0.5)  # y in [-127, 127]: the result stays in range
    return y.to(code_dtype), absmax / code_max


def dequantize_kv(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., head_dim], scales [...] -> values [..., head_dim] of dtype (computed in fp32)."""
    return (codes.float() * scales.float()[..., None]).to(dtype)


@jit
def quantize_rows(x, CODE_MAX: tl.constexpr, ROUND: tl.constexpr, FP8_UNIT: tl.constexpr):
    """Triton quantize_kv of a [ROWS, D] tile (masked lanes 0): (codes as fp32 [ROWS, D], scales [ROWS]).
    ROUND: int8 codes (round half up); otherwise fp8 values, already on the grid of the e4m3 variant whose
    bit pattern of 1.0 is worth FP8_UNIT (round_to_e4m3)."""
    x = x.to(tl.float32)
    absmax = tl.max(tl.abs(x), 1)
    inv_scale = tl.where(absmax > 0.0, CODE_MAX / tl.maximum(absmax, 1e-30), 0.0)
    y = tl.minimum(tl.maximum(x * inv_scale[:, None], -CODE_MAX), CODE_MAX)
    if ROUND:
        y = tl.floor(y + 0.5)
    else:
        y = round_to_e4m3(y / FP8_UNIT) * FP8_UNIT
    return y, absmax / CODE_MAX


@jit
def round_to_e4m3(y):
    """fp32 values (|y| <= 448) rounded to the nearest float8 e4m3 value, so that the cast to fp8 is exact.

    NOTE: the Triton interpreter's fp32 -> fp8 cast drops the carry when rounding up crosses a power of
    two (127.9 -> 64); rounding here first keeps every backend exact. Normal range: round-to-nearest-even
    on the 3 top mantissa bits; below 2**-6 (subnormal): the nearest multiple of 2**-9, ties to even, by
    adding and removing 1.5 * 2**14, whose fp32 spacing is 2**-9."""
    bits = y.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # -0x100000: mask 0xFFF00000
    normal = bits.to(tl.float32, bitcast=True)
    subnormal = (y + 24576.0) - 24576.0
    return tl.where(tl.abs(y) < 0.015625, subnormal, normal)
