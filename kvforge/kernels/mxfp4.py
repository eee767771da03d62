"""MXFP4 (OCP microscaling, FP4): the format GPT-OSS checkpoints ship their MoE experts in.

A weight [rows, K] (rows: output features, K: input features, a multiple of 32) is cut along K into blocks of 32
values; each block keeps one shared power-of-two scale and 32 FP4 (e2m1) codes, two to a byte:

    blocks  uint8 [..., rows, K / 32, 16]   byte j of a block: value 2j in its low nibble, value 2j + 1 in its high
    scales  uint8 [..., rows, K / 32]       E8M0: the block's scale is 2 ** (s - 127)

    code  = s e1 e0 m        (sign, 2 exponent bits, 1 mantissa bit)
    value = (-1) ** s * (m / 2                      if e == 0     subnormal: 0, 0.5
                         (1 + m / 2) * 2 ** (e - 1)  otherwise)    1, 1.5, 2, 3, 4, 6

    weight[r, 32 b + i] = value(code of value i of block b of row r) * 2 ** (scales[r, b] - 127)

Checkpoints name them `<proj>_blocks` and `<proj>_scales` (GPT-OSS: `mlp.experts.gate_up_proj_blocks` [experts,
2 * inter, hidden / 32, 16], `mlp.experts.down_proj_blocks` [experts, hidden, inter / 32, 16]); a checkpoint in this
format says `"quantization_config": {"quant_method": "mxfp4"}` and keeps every other tensor in float.

The quantizer follows the OCP definition: a block's shared exponent is floor(log2(max |x|)) - 2 (2 being e2m1's
largest exponent), each x / 2 ** shared is rounded to the nearest e2m1 value (ties to the even code) and clamped to
+-6.
"""

from __future__ import annotations

import torch

BLOCK_SIZE = 32  # values that share one scale
SCALE_BIAS = 127  # E8M0: scale = 2 ** (s - 127)
E2M1_MAX_EXPONENT = 2  # the largest e2m1 value is 1.5 * 2 ** 2 = 6
# The e2m1 values of codes 0..15 (bit 3 the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """ValueError unless blocks [..., rows, K / 32, 16] and scales [..., rows, K / 32] are uint8 and agree."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK_SIZE // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks must be [..., rows, K / 32, 16] and scales [..., rows, K / 32], got "
            f"{tuple(blocks.shape)} and {tuple(scales.shape)}"
        )


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight of MXFP4 blocks and scales: [..., rows, K] in dtype (the reference dequantizer)."""
    check_mxfp4(blocks, scales)
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., rows, K / 32, 16, 2]
    scale = torch.exp2(scales.float() - SCALE_BIAS)[..., None, None]
    weight = values[codes] * scale  # exact in fp32: a code times a power of two
    return weight.reshape(*scales.shape[:-1], -1).to(dtype)


def _round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """The e2m1 codes (uint8, 0..15) nearest to x (already scaled to [-6, 6]); ties go to the even code."""
    magnitudes = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=x.device)
    distance = (x.abs()[..., None] - magnitudes).abs()  # [..., 8]
    # NOTE: a tie (x halfway between two values) picks the even code: its distance is made the smaller by 1e-7
    even_first = distance - 1e-7 * (torch.arange(8, device=x.device) % 2 == 0)
    code = even_first.argmin(dim=-1).to(torch.uint8)
    return torch.where(x < 0, code | 0x08, code)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., rows, K] (K a multiple of 32) -> (blocks uint8 [..., rows, K / 32, 16], scales uint8 [..., rows,
    K / 32]), by the OCP definition (module docstring)."""
    if weight.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"MXFP4 needs the last dim to be a multiple of {BLOCK_SIZE}, got {tuple(weight.shape)}")
    groups = weight.float().reshape(*weight.shape[:-1], -1, BLOCK_SIZE)  # [..., rows, K / 32, 32]
    amax = groups.abs().amax(dim=-1)
    exponent = torch.floor(torch.log2(amax.clamp(min=2.0**-SCALE_BIAS))) - E2M1_MAX_EXPONENT
    exponent = exponent.clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = (groups / torch.exp2(exponent)[..., None]).clamp(-6.0, 6.0)
    codes = _round_to_e2m1(scaled).reshape(*groups.shape[:-1], BLOCK_SIZE // 2, 2)
    blocks = codes[..., 0] | (codes[..., 1] << 4)
    return blocks.contiguous(), (exponent + SCALE_BIAS).to(torch.uint8)


def mxfp4_bytes(rows: int, k: int) -> int:
    """Bytes of one [rows, K] weight in MXFP4: half a byte a value and one byte per 32 values (4.25 bits a value)."""
    return rows * k // 2 + rows * k // BLOCK_SIZE
