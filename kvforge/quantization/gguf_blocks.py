"""The block layouts of GGUF's quantized types, each decoded as "codes + per-group scale + zero point":
the QuantizedWeight W = (codes - zeros) * scales that gives back gguf's own dequantized values.

A row of K weights is cut into blocks of 32 or 256 columns. d, m and dmin are float16; q[i] is the
integer of weight i of the block, and "a | b << 4" packs a in the low bits of a byte.

    Q8_0    34 B  [d][q: 32 x int8]                 w = d * q
    Q4_0    18 B  [d][qs: 16]                       w = d * (q - 8)
    Q4_1    20 B  [d][m][qs: 16]                    w = d * q + m
    Q5_0    22 B  [d][qh: 4][qs: 16]                w = d * (q - 16)
    Q5_1    24 B  [d][m][qh: 4][qs: 16]             w = d * q + m
    IQ4_NL  18 B  [d][qs: 16]                       w = d * kvalues[q]    (kvalues: 16 int8 in [-127, 113])
            qs[j] = q[j] | q[j + 16] << 4 (the low 4 bits of q); bit i of qh (a little-endian uint32) is
            bit 4 of q[i]

The K-quants and IQ4_XS have blocks of 256 columns, cut into sub-blocks s of 32 or 16 columns, each with
its own integer scale sc[s] (and min m[s]) times the block's d (and dmin):

    Q4_K   144 B  [d][dmin][scales: 12][qs: 128]            8 x 32: w = d * sc[s] * q - dmin * m[s]
    Q5_K   176 B  [d][dmin][scales: 12][qh: 32][qs: 128]    8 x 32: the same, q of 5 bits
            qs[32c + l] = q[64c + l] | q[64c + 32 + l] << 4          (low 4 bits; c < 4, l < 32)
            qh[l] >> s & 1 = bit 4 of q[32s + l]
            scales: 6-bit sc[s] and m[s], s < 8:
              byte 0-3   sc[0-3] | (bits 4-5 of sc[4-7]) << 6
              byte 4-7   m[0-3]  | (bits 4-5 of m[4-7]) << 6
              byte 8-11  (bits 0-3 of sc[4-7]) | (bits 0-3 of m[4-7]) << 4
    Q6_K   210 B  [ql: 128][qh: 64][sc: 16 x int8][d]       16 x 16: w = d * sc[s] * (q - 32)
            ql[64h + l] = q[128h + l] | q[128h + 64 + l] << 4        (low 4 bits; h < 2, l < 64)
            qh[32h + l] >> 2j & 3 = bits 4-5 of q[128h + 32j + l]    (j < 4, l < 32)
    Q3_K   110 B  [hmask: 32][qs: 64][scales: 12][d]        16 x 16: w = d * (sc[s] - 32) * (q - 4)
            qs as Q2_K's (the low 2 bits of q); hmask[l] >> j & 1 = bit 2 of q[32j + l]   (j < 8)
            scales: 6-bit sc[s], s < 16: bits 0-3 in byte s % 8 (low nibble for s < 8, else high),
            bits 4-5 in byte 8 + s % 4 at bit 2 * (s // 4)
    Q2_K    84 B  [scales: 16][qs: 64][d][dmin]             16 x 16: w = d * sc[s] * q - dmin * m[s]
            scales[s] = sc[s] | m[s] << 4
            qs[32h + l] >> 2j & 3 = q[128h + 32j + l]                (h < 2, j < 4, l < 32)
    IQ4_XS 136 B  [d][scales_h: 2][scales_l: 4][qs: 128]    8 x 32: w = d * (ls[s] - 32) * kvalues[q]
            ls[s] = (scales_l[s // 2] >> 4 * (s % 2) & 15) | (scales_h (uint16) >> 2s & 3) << 4
            qs[16s + j] = q[32s + j] | q[32s + 16 + j] << 4          (j < 16)

As QuantizedWeights, one group per block or sub-block (kvalues take 8 bits, Q5_0's shifted codes 6):

    type    bits  group  codes             scales          zeros
    Q8_0    8     32     q + 128           d               128
    Q4_0    4     32     q                 d               8
    Q4_1    4     32     q                 d               -m / d
    Q5_0    6     32     q + 16            d               32
    Q5_1    5     32     q                 d               -m / d
    IQ4_NL  8     32     kvalues[q] + 128  d               128
    Q4_K    4     32     q                 d * sc          dmin * m / (d * sc)
    Q5_K    5     32     q                 d * sc          dmin * m / (d * sc)
    Q6_K    6     16     q                 d * sc          32                      (sc may be negative)
    Q3_K    4     16     q + 4             d * (sc - 32)   8
    Q2_K    4     16     q                 d * sc          dmin * m / (d * sc)
    IQ4_XS  8     32     kvalues[q] + 128  d * (ls - 32)   128

The types with integer zero points take 8 (4-bit codes), 32 (6-bit) or 128 (8-bit), shifting their codes there: the
CPU's panel kernel keeps no offsets for such weights (kernels/cpu/quant_panels.py). They dequantize to gguf's values
bit for bit; those with float ones
(Q4_1, Q5_1, Q4_K, Q5_K, Q2_K) to within float32 rounding, because (q - z) * s rounds three times
where s * q + o rounds twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import IQ4_NL

from kvforge.kernels.cpu.extension import cpu_kernels
from kvforge.quantization.quantized_weight import QuantizedWeight

# codes uint8 [N, K], scales float32 [N, K / group_size], zeros float32 [N, K / group_size]
Decoded = tuple[np.ndarray, np.ndarray, np.ndarray]
# IQ4's 4-bit index -> its 8-bit code, kvalues[q] + 128
_IQ4_CODES = (np.array(IQ4_NL.kvalues, dtype=np.int16) + 128).astype(np.uint8)


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """One GGUF block type: its size, the codes and groups it decodes into, and its decoder from the raw
    blocks uint8 [N, num_blocks, block_bytes] of an [N, K] matrix."""

    block_size: int  # columns per block
    block_bytes: int
    bits: int  # of the codes the kernel reads: 4, 5, 6 or 8
    group_size: int  # columns per scale and zero point
    decode: Callable[[np.ndarray], Decoded]


def _half(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 at byte offset of every block [N, B, block_bytes], as float32 [N, B]."""
    return np.ascontiguousarray(blocks[..., offset : offset + 2]).view(np.float16)[..., 0].astype(np.float32)


def _planes(packed: np.ndarray, width: int) -> np.ndarray:
    """uint8 [..., n] -> [..., 8 / width, n]: plane j holds bits [width * j, width * (j + 1)) of each byte."""
    shifts = np.arange(0, 8, width, dtype=np.uint8)[:, None]
    return (packed[..., None, :] >> shifts) & np.uint8((1 << width) - 1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """qs [..., n] -> q [..., 2n]: the low nibbles, then the high ones."""
    return _planes(qs, 4).reshape(*qs.shape[:-1], 2 * qs.shape[-1])


def _rows(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray | float) -> Decoded:
    """codes [N, ...] and scales, zeros [N, ...] (or one zero point for all) as [N, K] and [N, G]."""
    num_rows = scales.shape[0]
    if not isinstance(zeros, np.ndarray):
        zeros = np.full(scales.shape, zeros, dtype=np.float32)
    return codes.reshape(num_rows, -1), scales.reshape(num_rows, -1), zeros.reshape(num_rows, -1)


def _affine(codes: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> Decoded:
    """Groups whose weights are scale * q + offset (codes [N, G, g], scale and offset [N, G]) as
    (q - zeros) * scales, with the float zero points -offset / scale.

    NOTE: a group with scale 0 holds g copies of offset, which no zero point of scale 0 gives back; it
    is stored as codes 0, zero -1 and scale offset instead."""
    constant = scale == 0
    zeros = -(offset / np.where(constant, np.float32(1), scale))
    return _rows(
        np.where(constant[..., None], np.uint8(0), codes),
        np.where(constant, offset, scale),
        np.where(constant, np.float32(-1), zeros),
    )


def _q8_0(blocks: np.ndarray) -> Decoded:
    return _rows(blocks[..., 2:] ^ np.uint8(0x80), _half(blocks, 0), 128)  # int8 q -> q + 128


def _q4_0(blocks: np.ndarray) -> Decoded:
    return _rows(_nibbles(blocks[..., 2:]), _half(blocks, 0), 8)


def _q4_1(blocks: np.ndarray) -> Decoded:
    return _affine(_nibbles(blocks[..., 4:]), _half(blocks, 0), _half(blocks, 2))


def _five_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1's q [..., 32] from qh [..., 4] and qs [..., 16]."""
    return _nibbles(qs) | (np.unpackbits(qh, axis=-1, bitorder="little") << np.uint8(4))


def _q5_0(blocks: np.ndarray) -> Decoded:
    return _rows(_five_bits(blocks[..., 2:6], blocks[..., 6:]) + np.uint8(16), _half(blocks, 0), 32)


def _q5_1(blocks: np.ndarray) -> Decoded:
    return _affine(_five_bits(blocks[..., 4:8], blocks[..., 8:]), _half(blocks, 0), _half(blocks, 2))


def _iq4_nl(blocks: np.ndarray) -> Decoded:
    return _rows(_IQ4_CODES[_nibbles(blocks[..., 2:])], _half(blocks, 0), 128)


def _k_scale_min(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's sub-block scales d * sc and offsets -dmin * m, float32 [N, B, 8]."""
    low, mins, high = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]
    sc = np.concatenate([low & 63, (high & 15) | (low >> 2 & 48)], axis=-1).astype(np.float32)
    m = np.concatenate([mins & 63, (high >> 4) | (mins >> 2 & 48)], axis=-1).astype(np.float32)
    return _half(blocks, 0)[..., None] * sc, -(_half(blocks, 2)[..., None] * m)


def _q4_k(blocks: np.ndarray) -> Decoded:
    num_rows, num_blocks = blocks.shape[:2]
    q = _planes(blocks[..., 16:].reshape(num_rows, num_blocks, 4, 32), 4)  # [N, B, 4, 2, 32]
    return _affine(q.reshape(num_rows, num_blocks, 8, 32), *_k_scale_min(blocks))


def _q5_k(blocks: np.ndarray) -> Decoded:
    num_rows, num_blocks = blocks.shape[:2]
    low = _planes(blocks[..., 48:].reshape(num_rows, num_blocks, 4, 32), 4)  # [N, B, 4, 2, 32]
    q = low.reshape(num_rows, num_blocks, 8, 32) | (_planes(blocks[..., 16:48], 1) << np.uint8(4))
    return _affine(q, *_k_scale_min(blocks))


def _q6_k(blocks: np.ndarray) -> Decoded:
    num_rows, num_blocks = blocks.shape[:2]
    low = _planes(blocks[..., :128].reshape(num_rows, num_blocks, 2, 64), 4)  # [N, B, 2, 2, 64]
    high = _planes(blocks[..., 128:192].reshape(num_rows, num_blocks, 2, 32), 2)  # [N, B, 2, 4, 32]
    q = low.reshape(num_rows, num_blocks, 16, 16) | (high.reshape(num_rows, num_blocks, 16, 16) << np.uint8(4))
    scales = _half(blocks, 208)[..., None] * blocks[..., 192:208].view(np.int8).astype(np.float32)
    return _rows(q, scales, 32)


def _q3_k(blocks: np.ndarray) -> Decoded:
    num_rows, num_blocks = blocks.shape[:2]
    low = _planes(blocks[..., 32:96].reshape(num_rows, num_blocks, 2, 32), 2)  # [N, B, 2, 4, 32]
    high = _planes(blocks[..., :32], 1)  # [N, B, 8, 32]
    q = low.reshape(num_rows, num_blocks, 16, 16) | (high.reshape(num_rows, num_blocks, 16, 16) << np.uint8(2))
    sc_low = _planes(blocks[..., 96:104], 4).reshape(num_rows, num_blocks, 16)
    sc_high = _planes(blocks[..., 104:108], 2).reshape(num_rows, num_blocks, 16)
    sc = (sc_low | (sc_high << np.uint8(4))).astype(np.float32) - 32
    return _rows(q + np.uint8(4), _half(blocks, 108)[..., None] * sc, 8)


def _q2_k(blocks: np.ndarray) -> Decoded:
    num_rows, num_blocks = blocks.shape[:2]
    q = _planes(blocks[..., 16:80].reshape(num_rows, num_blocks, 2, 32), 2)  # [N, B, 2, 4, 32]
    packed = blocks[..., :16]
    scale = _half(blocks, 80)[..., None] * (packed & 15).astype(np.float32)
    offset = -(_half(blocks, 82)[..., None] * (packed >> 4).astype(np.float32))
    return _affine(q.reshape(num_rows, num_blocks, 16, 16), scale, offset)


def _iq4_xs(blocks: np.ndarray) -> Decoded:
    num_rows, num_blocks = blocks.shape[:2]
    scales_h = blocks[..., 2].astype(np.uint16) | (blocks[..., 3].astype(np.uint16) << 8)  # [N, B]
    high = (scales_h[..., None] >> np.arange(0, 16, 2, dtype=np.uint16)) & 3  # [N, B, 8]
    low = _planes(blocks[..., 4:8], 4).swapaxes(-1, -2).reshape(num_rows, num_blocks, 8)
    ls = (low | (high.astype(np.uint8) << np.uint8(4))).astype(np.float32) - 32
    q = _planes(blocks[..., 8:].reshape(num_rows, num_blocks, 8, 16), 4)  # [N, B, 8, 2, 16]
    return _rows(_IQ4_CODES[q], _half(blocks, 0)[..., None] * ls, 128)


_Q = GGMLQuantizationType
DECODE_WEIGHTS = 1 << 24  # weights decoded at a time
# GGUF block type -> its layout. F32 / F16 / BF16 are not blocks, and the other types have no decoder.
BLOCK_LAYOUTS: dict[GGMLQuantizationType, BlockLayout] = {
    _Q.Q8_0: BlockLayout(32, 34, bits=8, group_size=32, decode=_q8_0),
    _Q.Q4_0: BlockLayout(32, 18, bits=4, group_size=32, decode=_q4_0),
    _Q.Q4_1: BlockLayout(32, 20, bits=4, group_size=32, decode=_q4_1),
    _Q.Q5_0: BlockLayout(32, 22, bits=6, group_size=32, decode=_q5_0),
    _Q.Q5_1: BlockLayout(32, 24, bits=5, group_size=32, decode=_q5_1),
    _Q.IQ4_NL: BlockLayout(32, 18, bits=8, group_size=32, decode=_iq4_nl),
    _Q.Q4_K: BlockLayout(256, 144, bits=4, group_size=32, decode=_q4_k),
    _Q.Q5_K: BlockLayout(256, 176, bits=5, group_size=32, decode=_q5_k),
    _Q.Q6_K: BlockLayout(256, 210, bits=6, group_size=16, decode=_q6_k),
    _Q.Q3_K: BlockLayout(256, 110, bits=4, group_size=16, decode=_q3_k),
    _Q.Q2_K: BlockLayout(256, 84, bits=4, group_size=16, decode=_q2_k),
    _Q.IQ4_XS: BlockLayout(256, 136, bits=8, group_size=32, decode=_iq4_xs),
}


def decode_blocks(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> QuantizedWeight:
    """The raw blocks of a GGUF tensor of shape [N, K] (rows first) as a QuantizedWeight, without a detour
    through float: its codes, and the scale and zero point of every group of layout.group_size columns."""
    layout = BLOCK_LAYOUTS.get(qtype)
    if layout is None:
        raise ValueError(
            f"GGUF type {qtype.name} has no block decoder; decoded: {', '.join(t.name for t in BLOCK_LAYOUTS)}"
        )
    num_rows, in_features = shape
    num_blocks = in_features // layout.block_size
    if in_features % layout.block_size or data.nbytes != num_rows * num_blocks * layout.block_bytes:
        raise ValueError(
            f"{data.nbytes} bytes of {qtype.name} blocks do not hold a {num_rows}x{in_features} matrix "
            f"(blocks of {layout.block_size} columns in {layout.block_bytes} bytes)"
        )
    # NOTE: a read-only array (a mapped file's) is copied: torch takes only writable ones
    blocks = np.require(data, requirements=("C", "W")).view(np.uint8).reshape(num_rows, num_blocks, layout.block_bytes)
    if cpu_kernels() is not None:  # the same values in one pass, rows in parallel (csrc/gguf_decode.cpp)
        codes, scales, zeros = torch.ops.kvforge_cpu.gguf_decode(torch.from_numpy(blocks), int(qtype))
        return QuantizedWeight(codes, scales, zeros, layout.bits)
    return decode_blocks_ref(blocks, layout)


def decode_blocks_ref(blocks: np.ndarray, layout: BlockLayout) -> QuantizedWeight:
    """decode_blocks in numpy (the reference, and the path without the C++ extension): blocks [N, B, block bytes]."""
    num_rows, num_blocks = blocks.shape[:2]
    in_features = num_blocks * layout.block_size
    groups = in_features // layout.group_size
    codes = np.empty((num_rows, in_features), dtype=np.uint8)
    scales, zeros = (np.empty((num_rows, groups), dtype=np.float32) for _ in range(2))
    # NOTE: in runs of rows, so that a decoder's temporaries (several times the codes) stay a few tens of MB for a
    # vocabulary of 128k rows, not several GB
    step = max(1, DECODE_WEIGHTS // in_features)
    for first in range(0, num_rows, step):
        rows = slice(first, first + step)
        codes[rows], scales[rows], zeros[rows] = layout.decode(blocks[rows])
    return QuantizedWeight(torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(zeros), layout.bits)
