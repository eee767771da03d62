"""Weight-only quantized matmul on AVX-512 VNNI CPUs: row panels with int8 activations (csrc/quant_panels.cpp).

One kernel for every batch size (decode, batched decode, prefill chunks): x is rounded to int8 per 32 columns and
one vpdpbusd multiplies 4 columns of 16 weight rows at once, so above a few rows it is several times the float
GEMM's rate and never dequantizes the weight. Layout, one uint8 tensor a weight: P = ceil(N / 16) panels of 16 rows
in T parts of S = ceil(P / T) panels (one part a thread; zero rows pad the last panels), each part in tiles of W
panels (W = tile_panels(bits): 4 for 4-, 5- and 6-bit codes, 2 for 8-bit; the part's last tile has the 1 .. W
left), and per group of B 32-column blocks of a tile (or of half a block: groups of 16 columns) one run of bytes, in
the order the kernel reads them:

    weight   uint8 [T, S, G, 64 + B * V * 64]      the sizes of a panel's group; a tile's groups hold its W panels'
                                                   bytes interleaved: group g of the tile of panels s .. s + W is
        scales half [W, 16] | offsets half [W, 16] | per block b, V vectors per panel [V, W, 64 bytes]
                      the panels' rows side by side, times 2^e; vector j of a panel, one int32 lane (4 bytes) a row:
                      8 bits, V = 8:  [row 0: c(32b+4j .. 32b+4j+3) | row 1: ... | ... | row 15: ...]
                      4 bits, V = 4:  row r, byte c = c(r, 32b+8j+c) | c(r, 32b+8j+4+c) << 4
                      5 bits, V = 5:  j < 4 the low 4 bits as the 4-bit vector j; j = 4, row r, byte c: bit s is
                                      bit 4 of c(r, 32b+4s+c) (GGUF's Q5_1 and Q5_K: 0.625 bytes a weight)
                      6 bits, V = 6:  j = 3h + v (h < 2): v < 2 the low 4 bits of the 4-bit vector 2h + v; v = 2
                                      the top 2 bits of columns 32b+16h+4i+c in bits 2i, 2i+1 of byte c (i < 4)
        or, groups of 16 columns (GGUF's Q6_K, Q3_K, Q2_K; G even, the last dimension 64 + V/2 * 64; 6 bits: one h):
        scales half [W, 16] | offsets half [W, 16] | half h = g % 2 of block b = g // 2, [V/2, W, 64 bytes]
                      its vectors j = V/2 * h .. V/2 * h + V/2 - 1 as above (columns 32b+16h .. 32b+16h+15)
        symmetric weights (every zero point SYMMETRIC_ZERO[bits]: 8, 32 or 128) keep no offsets (the last dimension
        32 + ...): scales half [W, 16] | the vectors as above; the kernel takes offsets = -zero * scales
        or super-blocks (6-bit symmetric codes in groups of 16 whose scales are int8 sc times one float32 d per 256
        columns, as GGUF's Q6_K stores them: G = K / 256, the last dimension SUPER_HEADER + 48 * 64):
        sc int8 [W, 16 sub-blocks, 16] | d float32 [W, 16] | per block b of the 8, [6, W, 64 bytes] as above
                      W[n, k] = (code[n, k] - 32) * sc[n, k // 16] * d[n, k // 256] (factor 1)
        or super-blocks with mins (4- or 5-bit codes in groups of 32 whose scales are 6-bit sc times a half d and
        whose zero * scale are 6-bit m times a half dmin per 256 columns, as GGUF's Q4_K and Q5_K store them:
        G = K / 256, the last dimension MINS_HEADER + 8 * V * 64):
        sc uint8 [W, 8 sub-blocks, 16] | m uint8 [W, 2 quads, 16 rows, 4 sub-blocks] | d half [W, 16] |
        dmin half [W, 16] | per block b of the 8, [V, W, 64 bytes] as above
                      W[n, k] = code[n, k] * sc[n, k // 32] * d[n, k // 256] - m[n, k // 32] * dmin[n, k // 256]
                   the parts may lie apart in memory (the first stride, a multiple of 64 bytes)
    factor   2^-e  one power of two per weight, that puts its largest scale or offset in [2^14, 2^15): no half is
                   subnormal or overflows
    offsets  = -zeros * scales

    W[n, k] = (code[n, k] * scales[n, g] + offsets[n, g]) * factor,   g = k // group_size

x is rounded to int8 per 32 columns in every layout but super-blocks; with groups of 16 the kernel keeps a block's
int32 sums per half block, each times its own scale, and the sum of x over a group (times its offset) is the half
block's q times dx. In super-blocks x is rounded per 256 columns (as llama.cpp's K-quant dot products round it), and
the kernel adds each sub-block's sum of (code - 32) * q times its sc in int32 over the super-block: one float
multiply-add per super-block where half scales take sixteen, and 0.83 bytes a weight where they take 0.88. With mins
it adds each sub-block's sum of code * q times its sc, and each m times x's sum over the sub-block, in int32: two
float multiply-adds per super-block where half scales and offsets take sixteen, and 0.58 bytes a 4-bit weight (GGUF's
Q4_K: 0.5625) where they take 0.625, 0.70 a 5-bit one (Q5_K: 0.6875) where they take 0.75. The packer finds the
super-blocks in any weight's scales and zero points (csrc/panel_pack.cpp); where some super-block has none, the
weight keeps a half a group.

One row of x reads each tile as one run of memory. Thread t multiplies part t, so the loader puts part t of every
weight, one after another in the order the model calls them, into one region of memory (pack_panels writes it
there: PanelArena in quantization/weight_only_kernels.py): each thread then reads one run through a whole decode step.
Half factors cut a 4-bit weight's bytes from 0.75 to 0.625 per weight (as GGUF's Q4_1), and are exact for GGUF's Q8_0,
Q4_0 and Q4_1 blocks, whose scales and minimums are halves; float32 ones (RTN, GPTQ's integer zero points times a
scale, the K-quants' half times a sub-block scale) round by at most 2^-11 of their value.

From 64 rows of x (prompts, batches of streams), on CPUs with AMX-INT8, the same op takes csrc/quant_panels_amx.cpp:
four panels' codes unpacked to a byte each and multiplied by 16 rows of x per tile instruction, then the same float
work in the same order, so every row's output is the same bits on either path (a request's tokens do not depend on
what else shares its step); super-blocks' codes are unpacked times their sc, as two int8 tiles.

References beside it: panel_linear_ref (x rounded the same way, times the dequantized weight), pack_panels_ref (the
layout in torch ops).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch

from kvforge.kernels.cpu.extension import cpu_kernels

PANEL_ROWS = 16
BLOCK = 32  # columns per scale of x, and the group-size unit
HALF_BLOCK = 16  # the one group size below a block (GGUF's Q6_K, Q3_K, Q2_K)
SYMMETRIC_ZERO = {4: 8, 5: 16, 6: 32, 8: 128}  # the zero point of a weight whose layout keeps no offsets
SUPER_BLOCK = 256  # columns of a super-block: 16 groups of 16 whose scales are int8 times one float32
SUPER_HEADER = 16 * PANEL_ROWS + 4 * PANEL_ROWS  # a panel's bytes of a super-block's int8 and float32 scales
MINS_GROUP = 32  # columns of a sub-block of a super-block with mins (4- or 5-bit codes: GGUF's Q4_K, Q5_K)
MINS_HEADER = 2 * 8 * PANEL_ROWS + 4 * PANEL_ROWS  # a panel's bytes of its 6-bit sc and m, half d and dmin
MINS_RANGE = range(63, 0, -1)  # candidates of a super-block's largest sc or m (63 from GGUF's quantizers, or less)
MINS_TOLERANCE = 2.0**-20  # how near min / dmin comes to its integer m (csrc/panel_pack.cpp, kMinsTolerance)


@functools.cache
def panels_available() -> bool:
    """The C++ extension is built with AVX-512 VNNI, which the panel kernel needs."""
    return cpu_kernels() is not None and torch.ops.kvforge_cpu.quant_panels_available()


def tile_panels(bits: int) -> int:
    """Panels interleaved in a tile."""
    return 2 if bits == 8 else 4


def panel_layout_fits(bits: int, in_features: int, group_size: int) -> bool:
    """4-, 5-, 6- or 8-bit codes in groups of whole 32-column blocks, or (but 5-bit ones) of half a block (16 columns)
    in whole blocks."""
    whole_blocks = group_size > 0 and group_size % BLOCK == 0
    fits_blocks = whole_blocks or (group_size == HALF_BLOCK and bits != 5)
    return bits in (4, 5, 6, 8) and fits_blocks and in_features % max(group_size, BLOCK) == 0


def _checked_parts(bits: int, in_features: int, groups: int, parts: int | None) -> int:
    """The layout's checks; returns the number of parts (default: torch's thread count)."""
    if not panel_layout_fits(bits, in_features, in_features // groups) or in_features % groups:
        raise ValueError(f"no panel layout for {bits}-bit codes of width {in_features} in {groups} groups")
    parts = torch.get_num_threads() if parts is None else parts
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    return parts


def _exponent(largest: float) -> int:
    """e of the factor 2^-e that puts the largest scale or offset in [2^14, 2^15)."""
    return 0 if largest == 0 else 14 - math.floor(math.log2(largest))


def panel_part_bytes(num_rows: int, in_features: int, groups: int, bits: int, symmetric: bool, parts: int,
                     super_blocks: bool = False) -> tuple[tuple[int, int, int, int], int]:
    """(the layout's shape [T, S, G, group bytes], the bytes of a part, padded to 64) of a weight [num_rows,
    in_features] in `groups` groups (super_blocks: kept as super-blocks, symmetric or with mins, G of the layout
    in_features / 256)."""
    per_part = -(-num_rows // (PANEL_ROWS * parts))
    if super_blocks:
        groups = in_features // SUPER_BLOCK
    vectors = bits * in_features // groups // BLOCK  # 64-byte vectors a panel's group: `bits` a 32-column block
    header = (SUPER_HEADER if symmetric else MINS_HEADER) if super_blocks else 32 if symmetric else 64
    group_bytes = header + 64 * vectors
    return (parts, per_part, groups, group_bytes), -(-per_part * groups * group_bytes // 64) * 64


def _super_factor(values: torch.Tensor, ks: Sequence[int], low: int, high: int, tolerance: float, half: bool
                  ) -> torch.Tensor | None:  # fmt: skip
    """Each super-block's factor f [..] of its values [.., n]: every v / f within tolerance * |v / f| of an integer q in
    [low, high] (tolerance 0: q * f == v), f = largest / k (half: rounded to a half) for the first k of ks that fits
    (largest: the first largest |v|, signed); 0 where every v is 0; None where some super-block has no such k
    (super_factor in csrc/panel_pack.cpp, the same float32 operations)."""
    largest = values.gather(-1, values.abs().argmax(dim=-1, keepdim=True))  # signed
    found = torch.zeros_like(largest)
    for k in ks:
        factor = (largest / k).half().float() if half else largest / k
        ratio = torch.where(factor != 0, values / torch.where(factor != 0, factor, 1), 0)
        q = ratio.round()
        near = (q - ratio).abs() <= tolerance * ratio.abs()
        fits = (q >= low) & (q <= high) & near & ((q * factor == values) if tolerance == 0 else near)
        found = torch.where((found == 0) & fits.all(dim=-1, keepdim=True) & (factor != 0), factor, found)
        if bool(((found != 0) | (largest == 0)).all()):
            return found[..., 0]
    return None


def _super_scales(scales: torch.Tensor) -> torch.Tensor | None:
    """d [N, K / 256] float32 with scales [N, K / 16] = d * sc exactly for int8 sc in every super-block of 16 groups,
    or None where some super-block has none. GGUF's Q6_K makes its largest scale s's sc -128 (d = -s / 128, a
    half); a quantizer that gives it 127 is found too."""
    blocks = scales.float().reshape(scales.shape[0], -1, SUPER_BLOCK // HALF_BLOCK)
    return _super_factor(blocks, (-128, 127), -128, 127, 0.0, half=False)


def _scales_and_mins(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A weight with zero points in groups of 32 as scale and min a group (its weights code * scale - min): (scales,
    zeros * scales), but a group of codes 0 and zero point -1 whose scale is not positive (GGUF's decoder's group of
    scale 0, every weight its `scale`) as (0, -scale)."""
    blank = (codes.reshape(*scales.shape, MINS_GROUP) == 0).all(dim=-1)
    special = (zeros == -1) & (scales <= 0) & blank
    return torch.where(special, 0.0, scales), torch.where(special, -scales, zeros * scales)


def _super_mins(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor | None:
    """(d, dmin) [N, K / 256, 2] (halves, as float32) with each group's scale d * sc and min dmin * m
    (_scales_and_mins) for sc, m in [0, 63] in every super-block of 8 groups of 32 (GGUF's Q4_K and Q5_K), or None
    where some super-block has none."""
    found = [_super_factor(values.reshape(values.shape[0], -1, SUPER_BLOCK // MINS_GROUP), MINS_RANGE, 0, 63,
                           tolerance, half=True) for values, tolerance in zip(_scales_and_mins(codes, scales, zeros),
                                                                              (0.0, MINS_TOLERANCE))]  # fmt: skip
    return None if any(f is None for f in found) else torch.stack(found, dim=-1)


def _super_blocks(codes: list[torch.Tensor], scales: list[torch.Tensor], zeros: list[torch.Tensor], symmetric: bool,
                  bits: int, reference: bool = False) -> list[torch.Tensor] | None:  # fmt: skip
    """Each shard's super scales where its weight keeps them as super-blocks: 6-bit symmetric codes in groups of 16
    columns whose scales are int8 times a float32 a super-block (d [N_s, K / 256]), or 4- or 5-bit ones in groups of
    32 with mins (half d, dmin [N_s, K / 256, 2]); else None (csrc/panel_pack.cpp; reference: _super_scales,
    _super_mins)."""
    in_features = codes[0].shape[1]
    group = HALF_BLOCK if symmetric else MINS_GROUP
    if (bits != 6 if symmetric else bits not in (4, 5)) or in_features % SUPER_BLOCK:
        return None
    if any(s.shape[1] * group != in_features for s in scales):
        return None
    if not reference:
        return torch.ops.kvforge_cpu.panel_super_scales(codes, scales, zeros, bits, symmetric) or None
    found = [_super_scales(s) if symmetric else _super_mins(c, s, z) for c, s, z in zip(codes, scales, zeros)]
    return None if any(d is None for d in found) else found


Rows = torch.Tensor | Sequence[torch.Tensor]  # a tensor, or its row shards in order (a merged layer's q, k, v)
Place = Callable[[int, int], torch.Tensor]  # (parts, part bytes) -> an unwritten uint8 [parts, >= part bytes]


def pack_panels(codes: Rows, scales: Rows, zeros: Rows, bits: int, parts: int | None = None,
                place: Place | None = None) -> tuple[torch.Tensor, float]:
    """codes [N, K] in [0, 2**bits), scales and zeros [N, G] -> (weight, factor) of the layout, in `parts` parts
    (default: torch's thread count), written in one pass, tiles in parallel (csrc/panel_pack.cpp). Each of codes,
    scales and zeros may come as row shards stacked in order (no copy of them into one tensor), a shard's scales and
    zeros in G_s groups dividing G (each repeated G / G_s times); place: where the weight is written (default:
    memory of its own)."""
    codes, scales, zeros = ([rows] if isinstance(rows, torch.Tensor) else list(rows) for rows in (codes, scales, zeros))
    num_rows, in_features = sum(shard.shape[0] for shard in codes), codes[0].shape[1]
    groups = max(shard.shape[1] for shard in scales)
    parts = _checked_parts(bits, in_features, groups, parts)
    codes, scales, zeros = [c.to(torch.uint8) for c in codes], [s.float() for s in scales], [z.float() for z in zeros]
    symmetric, largest = torch.ops.kvforge_cpu.panel_factors(scales, zeros, bits)
    supers = _super_blocks(codes, scales, zeros, symmetric, bits)
    exponent = 0 if supers else _exponent(largest)  # float32 super scales: no multiplier
    shape, part_bytes = panel_part_bytes(num_rows, in_features, groups, bits, symmetric, parts, supers is not None)
    out = torch.empty(parts, part_bytes, dtype=torch.uint8) if place is None else place(parts, part_bytes)
    torch.ops.kvforge_cpu.pack_panels(codes, scales, zeros, supers or [], bits, symmetric, 2.0**exponent, out)
    groups, group_bytes = shape[2:]
    return out.as_strided(shape, (out.stride(0), groups * group_bytes, group_bytes, 1)), 2.0**-exponent


def pack_panels_ref(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                    parts: int | None = None) -> tuple[torch.Tensor, float]:
    """What pack_panels writes (of one tensor each), in torch ops (the reference)."""
    num_rows, in_features = codes.shape
    groups = scales.shape[1]
    parts = _checked_parts(bits, in_features, groups, parts)
    symmetric = bool((zeros == SYMMETRIC_ZERO[bits]).all())  # then no offsets are stored
    supers = _super_blocks([codes.to(torch.uint8)], [scales.float()], [zeros.float()], symmetric, bits, reference=True)
    largest = scales.abs().max().item()
    if not symmetric:
        largest = max(largest, (-zeros.float() * scales.float()).abs().max().item())
    exponent = 0 if supers else _exponent(largest)
    per_part = -(-num_rows // (PANEL_ROWS * parts))  # ceil(ceil(N / 16) / T)
    panels = parts * per_part
    pad = panels * PANEL_ROWS - num_rows
    codes = torch.nn.functional.pad(codes.to(torch.uint8), (0, 0, 0, pad))
    offsets = torch.nn.functional.pad(-zeros.float() * scales.float(), (0, 0, 0, pad))
    scales = torch.nn.functional.pad(scales.float(), (0, 0, 0, pad))
    blocks = codes.reshape(panels, PANEL_ROWS, in_features // BLOCK, BLOCK)  # [P, r, b, 32]
    if bits == 8:
        vectors = blocks.reshape(panels, PANEL_ROWS, -1, 8, 4)  # [P, r, b, j, c]
    elif bits in (4, 5):
        halves = blocks.reshape(panels, PANEL_ROWS, -1, 4, 2, 4)  # [P, r, b, j, low/high, c]
        vectors = (halves[..., 0, :] & 15) | ((halves[..., 1, :] & 15) << 4)
        if bits == 5:  # then bit 4 of column 4 s + c in bit s of byte c: [P, r, b, 5, c]
            top = (blocks.reshape(panels, PANEL_ROWS, -1, 8, 4) >> 4) << torch.arange(8, dtype=torch.uint8)[:, None]
            vectors = torch.cat([vectors, top.sum(dim=3, dtype=torch.uint8)[..., None, :]], dim=3)
    else:
        halves = blocks.reshape(panels, PANEL_ROWS, -1, 2, 2, 2, 4)  # [P, r, b, h, v, low/high, c]
        nibbles = (halves[..., 0, :] & 15) | ((halves[..., 1, :] & 15) << 4)  # [P, r, b, h, v, c]
        top = (halves >> 4).flatten(4, 5)  # [P, r, b, h, i = 2v + low/high, c]
        top = top[..., 0, :] | (top[..., 1, :] << 2) | (top[..., 2, :] << 4) | (top[..., 3, :] << 6)
        vectors = torch.cat([nibbles, top[..., None, :]], dim=4).flatten(2, 4).reshape(panels, PANEL_ROWS, -1, 6, 4)
    layout_groups = in_features // SUPER_BLOCK if supers else groups
    # [T, S, G, B * V, 64]: per part, panel and group, the group's vectors (each 4 bytes of the panel's 16 rows); in
    # groups of 16 columns [T, S, G, V / 2, 64], the vectors of a block split between its two groups
    grid = vectors.permute(0, 2, 3, 1, 4).reshape(parts, per_part, layout_groups, -1, 4 * PANEL_ROWS)

    def side_by_side(factors: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [P * 16, G, ...] -> [T, S, G, bytes]
        grouped = factors.reshape(parts, per_part, PANEL_ROWS, layout_groups, -1).permute(0, 1, 3, 4, 2)
        return grouped.to(dtype).contiguous().view(torch.uint8).flatten(3)  # each panel's rows side by side

    if supers and not symmetric:  # uint8 sc [8 sub-blocks, 16 rows], m [2 quads, 16 rows, 4], half d, dmin [16]
        factors = torch.nn.functional.pad(supers[0], (0, 0, 0, 0, 0, pad))  # [P * 16, G, 2]
        values = [torch.nn.functional.pad(v, (0, 0, 0, pad)).reshape(*factors.shape[:2], -1)
                  for v in _scales_and_mins(codes[:num_rows], scales[:num_rows], zeros.float())]
        sc, m = (torch.where(f[..., None] != 0, v / torch.where(f[..., None] != 0, f[..., None], 1), 0).round()
                 for v, f in zip(values, factors.unbind(-1)))
        quads = m.reshape(parts, per_part, PANEL_ROWS, layout_groups, 2, 4).permute(0, 1, 3, 4, 2, 5)
        stored = [side_by_side(sc, torch.uint8), quads.to(torch.uint8).flatten(3),
                  *(side_by_side(f, torch.float16) for f in factors.unbind(-1))]
    elif supers:  # int8 [16 sub-blocks, 16 rows], then float32 [16 rows]
        d = torch.nn.functional.pad(supers[0], (0, 0, 0, pad))
        sc = torch.where(d[:, :, None] != 0, scales.reshape(d.shape[0], d.shape[1], -1) / d[:, :, None], 0)
        stored = [side_by_side(sc.round(), torch.int8), side_by_side(d, torch.float32)]
    else:
        stored = [side_by_side(factors * 2.0**exponent, torch.float16)
                  for factors in ([scales] if symmetric else [scales, offsets])]

    def tiles(first: int, count: int, width: int) -> torch.Tensor:  # `count` tiles of `width` panels -> [T, bytes]
        def cut(t: torch.Tensor) -> torch.Tensor:  # [T, S, G, ...] -> [T, tiles, G, width, ...]
            part = t[:, first:first + count * width]
            return part.reshape(parts, count, width, *t.shape[2:]).transpose(2, 3)

        header = [cut(factors).flatten(3) for factors in stored]  # [T, q, G, w * bytes] each
        vectors = cut(grid).transpose(3, 4)  # [T, q, G, B * V, w, 64]
        return torch.cat([*header, vectors.flatten(3)], dim=3).reshape(parts, -1)

    width = tile_panels(bits)
    whole = per_part // width * width
    weight = torch.cat([tiles(0, per_part // width, width), tiles(whole, 1, per_part - whole)], dim=1)
    group_bytes = weight.shape[1] // (per_part * layout_groups)
    # NOTE: a symmetric layout's part can end mid cache line; the kernel wants the parts 64 bytes apart
    weight = torch.nn.functional.pad(weight, (0, -weight.shape[1] % 64))
    shape = (parts, per_part, layout_groups, group_bytes)
    return weight.as_strided(shape, (weight.shape[1], layout_groups * group_bytes, group_bytes, 1)), 2.0**-exponent


def panel_rows(weight: torch.Tensor, factor: float, bits: int, ids: torch.Tensor, in_features: int) -> torch.Tensor:
    """The float32 weight rows W[ids] [len(ids), in_features] of the layout (an embedding lookup): each row's bytes
    gathered from the tile its panel lies in."""
    _, per_part, groups, group_bytes = weight.shape
    width, panels = tile_panels(bits), ids // PANEL_ROWS
    parts, slots = panels // per_part, panels % per_part
    lanes, places, tiles = (ids % PANEL_ROWS)[:, None], (slots % width)[:, None], slots // width  # [len, 1], [len]
    widths = torch.where(tiles < per_part // width, width, per_part % width)[:, None]  # of each row's tile
    # byte of each group of each row's tile: tiles of `widths` panels, each group of them widths * group_bytes
    starts = (tiles * width * groups * group_bytes)[:, None] + torch.arange(groups) * widths * group_bytes
    flat = weight.flatten(1)  # [T, S * G * group bytes]: a view, each part contiguous

    def halves(at: torch.Tensor) -> torch.Tensor:  # the half at each byte `at` [len, G] of the rows' parts
        return flat[parts[:, None, None], at[..., None] + torch.arange(2)].view(torch.float16)[..., 0].float()

    header = _header(weight, bits, in_features)
    if header == MINS_HEADER and bits != 6:  # uint8 sc [8 sub-blocks, 16 rows], m [2 quads, 16 rows, 4], half d, dmin
        subs = torch.arange(SUPER_BLOCK // MINS_GROUP)
        sc = flat[parts[:, None, None], (starts + 128 * places)[..., None] + 16 * subs + lanes[..., None]]
        m = flat[parts[:, None, None], (starts + 128 * (widths + places))[..., None] + 64 * (subs // 4) + subs % 4
                 + 4 * lanes[..., None]]  # fmt: skip
        d, dmin = (halves(starts + 256 * widths + 32 * (w + places) + 2 * lanes)[..., None] for w in (0, widths))
        scales, offsets = (sc.float() * d).flatten(1), -(m.float() * dmin).flatten(1)  # [len, G * 8]
    elif header == SUPER_HEADER:  # 6-bit codes: int8 [16 sub-blocks, 16 rows] a panel, then float32 [16 rows]
        subs = torch.arange(SUPER_BLOCK // HALF_BLOCK)
        sc = flat[parts[:, None, None], (starts + 256 * places)[..., None] + 16 * subs + lanes[..., None]]
        d = flat[parts[:, None, None], (starts + 256 * widths + 64 * places + 4 * lanes)[..., None] + torch.arange(4)]
        scales = (sc.view(torch.int8).float() * d.view(torch.float32)).flatten(1)  # [len, G * 16]
        offsets = -SYMMETRIC_ZERO[bits] * scales
    else:  # a panel's 32 bytes of half scales (and 32 of offsets, unless symmetric)
        scales = halves(starts + 32 * places + 2 * lanes)
        offsets = (halves(starts + 32 * (widths + places) + 2 * lanes) if header == 64
                   else -SYMMETRIC_ZERO[bits] * scales)
    vectors = torch.arange((group_bytes - header) // 64)[:, None]  # [B * V, 1] ([V / 2, 1] in groups of 16 columns)
    widths, places, lanes = widths[..., None, None], places[..., None, None], lanes[..., None, None]  # [len, 1, 1, 1]
    at = starts[..., None, None] + header * widths + 64 * (vectors * widths + places) + 4 * lanes + torch.arange(4)
    grid = flat[parts[:, None, None, None], at]
    if bits == 4:
        grid = torch.stack([grid & 0x0F, grid >> 4], dim=-2)  # [len, G, B * V, low/high, c]
    elif bits == 5:
        fives = grid.reshape(*grid.shape[:2], -1, 5, 4)  # [len, G, b, v (4 nibble vectors, then the top bits), c]
        nibbles = torch.stack([fives[..., :4, :] & 0x0F, fives[..., :4, :] >> 4], dim=-2)  # [len, G, b, j, lh, c]
        top = torch.stack([(fives[..., 4, :] >> s) & 1 for s in range(8)], dim=-2)  # [len, G, b, s = 2 j + lh, c]
        grid = nibbles | (top.reshape(nibbles.shape) << 4)
    elif bits == 6:
        triples = grid.reshape(*grid.shape[:2], -1, 3, 4)  # [len, G, h, v (2 nibbles, then the top bits), c]
        nibbles = torch.stack([triples[..., :2, :] & 0x0F, triples[..., :2, :] >> 4], dim=-2)  # [len, G, h, v, lh, c]
        top = torch.stack([(triples[..., 2, :] >> (2 * i)) & 3 for i in range(4)], dim=-2)  # [len, G, h, i, c]
        grid = nibbles | (top.reshape(nibbles.shape) << 4)
    row_codes = grid.reshape(ids.shape[0], -1).float()
    group_size = row_codes.shape[1] // scales.shape[1]
    return (row_codes * scales.repeat_interleave(group_size, dim=1)
            + offsets.repeat_interleave(group_size, dim=1)) * factor


def _header(weight: torch.Tensor, bits: int, in_features: int) -> int:
    """A panel's bytes of scales before its codes in a group of the layout: 32 or 64 (half scales, and offsets), or a
    super-block's SUPER_HEADER (6-bit codes) or MINS_HEADER (4- or 5-bit codes)."""
    return weight.shape[3] - 2 * bits * in_features // weight.shape[2]  # 16 rows of bits / 8 bytes a column


def panel_linear(x: torch.Tensor, weight: torch.Tensor, factor: float, bits: int, out_features: int) -> torch.Tensor:
    """x [M, K] float -> x W^T [M, out_features] in x's dtype (needs panels_available())."""
    return torch.ops.kvforge_cpu.quant_gemm_panels(x.float(), weight, bits, out_features, factor).to(x.dtype)


def int8_rows(x: torch.Tensor, columns: int = BLOCK) -> torch.Tensor:
    """x as the kernels with int8 activations (this one, the AVX2 GEMV) see it: per 32 columns (of a super-block's
    layout, 256), dx = max |x| / 127 and q = round(x / dx), then dx * q."""
    blocks = x.float().reshape(x.shape[0], -1, columns)
    dx = blocks.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.where(dx > 0, torch.round(blocks / torch.where(dx > 0, dx, 1)), 0)
    assert q.abs().max() <= 127
    return (q * dx).reshape(x.shape)


def panel_linear_ref(x: torch.Tensor, weight: torch.Tensor, factor: float, bits: int, out_features: int
                     ) -> torch.Tensor:  # fmt: skip
    """What panel_linear computes, in float64: x rounded to int8 per 32 columns (256 in a layout of super-blocks),
    times the dequantized weight."""
    rows = panel_rows(weight, factor, bits, torch.arange(out_features), x.shape[1])
    super_blocks = _header(weight, bits, x.shape[1]) in (SUPER_HEADER, MINS_HEADER)
    return int8_rows(x, SUPER_BLOCK if super_blocks else BLOCK).double() @ rows.double().t()
