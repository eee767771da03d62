"""The panel kernel (csrc/quant_panels.cpp: AVX-512 VNNI; from 64 rows of x, csrc/quant_panels_amx.cpp where the CPU has
AMX-INT8): against x rounded to int8 the same way in torch times the dequantized weight, up to its half scales (a
wrong lane, column or scale shows), its row gather equal to the weight, within the rounding of x of the float
product, and exact on GGUF's blocks; in groups of whole 32-column blocks and of half a block (16 columns, GGUF's Q6_K,
Q3_K and Q2_K), with scales of either sign; and a row of x gets the same bits whatever else its step multiplies;
5-bit codes (GGUF's Q5_1 and Q5_K) in 0.625 bytes. GGUF's Q6_K, whose sub-block scales are int8 times a half a
super-block, keeps them so, and Q4_K and Q5_K their 6-bit sub-block scales and mins (super-blocks: x rounded per 256
columns, integer sums over a super-block)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from kvforge.kernels.cpu.quant_panels import (
    MINS_HEADER,
    SUPER_BLOCK,
    SUPER_HEADER,
    int8_rows,
    pack_panels,
    pack_panels_ref,
    panel_layout_fits,
    panel_linear,
    panel_linear_ref,
    panel_rows,
    panels_available,
)
from kvforge.loader.huge_pages import huge_pages_offered
from kvforge.quantization.gguf_blocks import decode_blocks
from kvforge.quantization.quantized_weight import QuantizedWeight
from kvforge.quantization.weight_only_kernels import PanelArena, interleaved_views
from tests.kernels.cpu.test_quant_gemv_cpu import _tolerance, _weight
from tests.quantization.test_gguf_blocks import random_blocks

pytestmark = pytest.mark.skipif(not panels_available(), reason="the panel kernel needs AVX-512 VNNI")

# Groups of half a block (16 columns): odd rows (17, 33, 100: tiles of 1-4 panels), 2, 3 and 8 blocks a row.
HALF_BLOCK_SHAPES = [(17, 64, 16), (33, 96, 16), (100, 256, 16)]
# (rows, columns, group size): rows that do not fill the last panel (37, 13, 9, 75, 110), one panel, groups of one
# block, of a whole row, of three blocks (96), the default model's shapes, and 7 panels in two parts of 4 (on two
# threads a tile of 4 panels, and one of 2 and one of 1, at one row of x); then groups of half a block.
SHAPES = [(37, 128, 32), (16, 256, 256), (13, 576, 192), (9, 192, 96), (75, 576, 64), (40, 1536, 32), (110, 576, 32),
          *HALF_BLOCK_SHAPES]  # fmt: skip


def _signed(weight: QuantizedWeight, seed: int) -> QuantizedWeight:
    """weight with about half its scales negated (Q6_K's sub-block scales d * sc and Q3_K's d * (sc - 32) take either
    sign)."""
    signs = torch.randint(0, 2, weight.scales.shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return QuantizedWeight(weight.codes, weight.scales * signs, weight.zeros, weight.bits)


@pytest.mark.parametrize("bits", [8, 6, 4])
@pytest.mark.parametrize("num_rows,in_features,group_size", SHAPES)
@pytest.mark.parametrize("zeros", ["sym", "int", "float"])
def test_rows_of_the_layout_are_the_weight(bits: int, num_rows: int, in_features: int, group_size: int,
                                           zeros: str) -> None:  # fmt: skip
    weight = _weight(num_rows, in_features, bits, group_size, zeros, seed=num_rows)
    packed = pack_panels(weight.codes, weight.scales, weight.zeros, bits)
    ids = torch.tensor([num_rows - 1, 0, num_rows // 2, 0])
    error = (panel_rows(*packed, bits, ids, in_features).double() - weight.dequantize()[ids].double()).abs()
    group_size = in_features // weight.scales.shape[1]
    scales, zeros = (t.double().repeat_interleave(group_size, dim=1)[ids] for t in (weight.scales, weight.zeros))
    terms = (weight.codes[ids].double() + zeros.abs()) * scales  # half scales and offsets: 2^-11 of each
    assert (error <= 2**-11 * terms + 1e-6).all()


@pytest.mark.parametrize("bits", [8, 6, 4])
@pytest.mark.parametrize("num_rows,in_features,group_size", SHAPES)
@pytest.mark.parametrize("zeros", ["sym", "int", "float"])
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 6, 64])
def test_kernel_is_the_product_with_x_rounded_to_int8(
    bits: int, num_rows: int, in_features: int, group_size: int, zeros: str, num_tokens: int
) -> None:
    """Every step shape (whole tiles against 1-3 rows of x; pairs of panels, or the last one, against 4 rows and the
    1-3 left over), tiles of 1-4 panels, the partial last panel and padding panels."""
    weight = _weight(num_rows, in_features, bits, group_size, zeros, seed=num_rows + bits)
    packed = pack_panels(weight.codes, weight.scales, weight.zeros, bits)
    x = torch.randn(num_tokens, in_features, generator=torch.Generator().manual_seed(num_tokens)) * 3
    x[0, :32] = 0  # a block of zeros: dx = 0
    out = panel_linear(x, *packed, bits, num_rows)
    assert out.shape == (num_tokens, num_rows) and out.dtype == torch.float32
    reference = int8_rows(x).double() @ weight.dequantize().double().t()
    tolerance = _tolerance(int8_rows(x), weight, "panels")
    assert ((panel_linear_ref(x, *packed, bits, num_rows) - reference).abs() <= tolerance).all()
    error = (out.double() - reference).abs()
    assert (error <= tolerance).all(), error.max().item()


@pytest.mark.parametrize("bits", [8, 6, 4])
def test_kernel_is_within_the_rounding_of_x_of_the_float_product(bits: int) -> None:
    """Each element of x moves by at most dx / 2; the errors of a row's terms mostly cancel."""
    weight = _weight(96, 576, bits, 32, "float", seed=bits)
    x = torch.randn(20, 576, generator=torch.Generator().manual_seed(0))
    out = panel_linear(x, *pack_panels(weight.codes, weight.scales, weight.zeros, bits), bits, 96)
    reference = x.double() @ weight.dequantize().double().t()
    error = (out.double() - reference).abs()
    scale = reference.abs().mean()
    assert error.mean() <= 1e-2 * scale and error.max() <= 5e-2 * scale


@pytest.mark.parametrize("bits", [8, 6])
@pytest.mark.parametrize("group_size", [32, 16])
def test_full_range_codes_and_activations(bits: int, group_size: int) -> None:
    """Codes 0 and the largest against q = +-127 (the largest int32 sums a block adds), bfloat16 in and out."""
    top, zero = 2**bits - 1, 2.0 ** (bits - 1)
    codes = torch.tensor([[0, top] * 64, [top] * 128, [0] * 128], dtype=torch.uint8)
    scales, zeros = torch.full((3, 128 // group_size), 0.5), torch.full((3, 128 // group_size), zero)
    x = torch.tensor([[-1.0, 1.0] * 64, [1.0] * 128], dtype=torch.bfloat16)
    out = panel_linear(x, *pack_panels(codes, scales, zeros, bits), bits, 3)
    assert out.dtype == torch.bfloat16
    weight = (codes.double() - zero) * 0.5
    torch.testing.assert_close(out.double(), x.double() @ weight.t(), rtol=1e-2, atol=1e-6)


def test_layouts_without_whole_blocks_are_refused() -> None:
    """Groups of whole blocks or of half a block, in rows of whole blocks; nothing else."""
    assert panel_layout_fits(8, 64, 16) and panel_layout_fits(4, 96, 16) and panel_layout_fits(4, 96, 32)
    assert not panel_layout_fits(8, 48, 16)  # a row of one and a half blocks
    assert not any(panel_layout_fits(4, 64, group_size) for group_size in (0, 8, 48))
    assert not panel_layout_fits(2, 64, 16)
    with pytest.raises(ValueError, match="no panel layout"):
        pack_panels(torch.zeros(16, 48, dtype=torch.uint8), torch.ones(16, 1), torch.zeros(16, 1), 8)
    with pytest.raises(ValueError, match="no panel layout"):
        pack_panels(torch.zeros(16, 48, dtype=torch.uint8), torch.ones(16, 3), torch.zeros(16, 3), 8)


@pytest.mark.parametrize("bits", [8, 6, 4])
@pytest.mark.parametrize("num_rows,in_features,group_size", [(110, 576, 32), (75, 576, 64), (16, 256, 256),
                                                             (100, 256, 16)])
@pytest.mark.parametrize("zeros", ["sym", "float"])
def test_a_row_gets_the_same_bits_in_any_step(bits: int, num_rows: int, in_features: int, group_size: int,
                                              zeros: str) -> None:  # fmt: skip
    """Each row of x alone (the VNNI loops) and the 150 rows together (from 64 rows the AMX path where the CPU has it:
    two passes of 128 rows, a last tile of 6 rows, panels four at a time and the 1-3 left) give the same bits, so a
    request's tokens do not depend on what else shares its step."""
    weight = _signed(_weight(num_rows, in_features, bits, group_size, zeros, seed=num_rows + bits), seed=bits)
    packed = pack_panels(weight.codes, weight.scales, weight.zeros, bits)
    x = torch.randn(150, in_features, generator=torch.Generator().manual_seed(bits)) * 3
    x[7, 32:64] = 0  # a block of zeros: dx = 0
    together = panel_linear(x, *packed, bits, num_rows)
    alone = torch.cat([panel_linear(row[None], *packed, bits, num_rows) for row in x])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("bits", [8, 6, 4])
@pytest.mark.parametrize("parts", [1, 2, 3, 5])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("num_tokens", [1, 5, 70])
@pytest.mark.parametrize("group_size", [32, 16])
def test_any_number_of_parts_on_any_number_of_threads(bits: int, parts: int, threads: int, num_tokens: int,
                                                      group_size: int) -> None:  # fmt: skip
    """A layout packed for one thread count runs on another (more parts than threads, or fewer; 9 panels in 5 parts
    of 2 end in a padding panel), with the same products and rows as the layout in one part."""
    weight = _weight(140, 576, bits, group_size, "float", seed=bits)
    x = torch.randn(num_tokens, 576, generator=torch.Generator().manual_seed(0))
    packed = pack_panels(weight.codes, weight.scales, weight.zeros, bits, parts=parts)
    assert packed[0].shape[:2] == (parts, -(-9 // parts))
    one_part = pack_panels(weight.codes, weight.scales, weight.zeros, bits, parts=1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = panel_linear(x, *packed, bits, 140)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out, panel_linear(x, *one_part, bits, 140))
    ids = torch.arange(140)
    assert torch.equal(panel_rows(*packed, bits, ids, 576), panel_rows(*one_part, bits, ids, 576))


@pytest.mark.parametrize("huge_pages", [False, True])
def test_weights_interleaved_by_part_answer_as_before(huge_pages: bool) -> None:
    """interleaved_views: each weight's parts apart in one arena (part t of every weight in region t, in order), the
    kernel and the row gather read them there with the same results."""
    if huge_pages and not huge_pages_offered():
        pytest.skip("the kernel offers no transparent huge pages")
    shapes = [(110, 576, 4), (37, 128, 8), (300, 1536, 4)]
    weights = [_weight(n, k, bits, 32, "int", seed=n) for n, k, bits in shapes]
    packed = [pack_panels(w.codes, w.scales, w.zeros, bits, parts=3) for w, (_, _, bits) in zip(weights, shapes)]
    views = interleaved_views([weight for weight, _ in packed], huge_pages)
    moved = [view.copy_(weight) for view, (weight, _) in zip(views, packed)]
    region = moved[0].stride(0)
    assert region % 64 == 0 and all(weight.stride(0) == region for weight in moved)
    starts = [weight.data_ptr() for weight in moved]
    assert starts == sorted(starts) and starts[0] % 64 == 0
    assert moved[-1][0].data_ptr() + moved[-1][0].nbytes <= starts[0] + region  # part 0 of each, then part 1 ...
    for (weight, factor), copy, (n, k, bits) in zip(packed, moved, shapes):
        assert torch.equal(copy, weight)
        x = torch.randn(3, k)
        assert torch.equal(panel_linear(x, copy, factor, bits, n), panel_linear(x, weight, factor, bits, n))
        ids = torch.tensor([n - 1, 0, n // 2])
        assert torch.equal(panel_rows(copy, factor, bits, ids, k), panel_rows(weight, factor, bits, ids, k))


def test_interleaving_needs_one_number_of_parts() -> None:
    weight = _weight(32, 128, 4, 32, "int", seed=0)
    with pytest.raises(ValueError, match="different numbers of parts"):
        interleaved_views([pack_panels(weight.codes, weight.scales, weight.zeros, 4, parts=parts)[0]
                           for parts in (1, 2)], huge_pages=False)


def test_layouts_that_do_not_match_are_refused() -> None:
    weight = _weight(64, 128, 4, 32, "int", seed=0)
    packed, factor = pack_panels(weight.codes, weight.scales, weight.zeros, 4, parts=2)
    x = torch.randn(1, 128)
    with pytest.raises(RuntimeError, match="does not fill 2 parts of 2 panels"):
        panel_linear(x, packed, factor, 4, 16)
    with pytest.raises(RuntimeError, match="each part of the weight must be contiguous"):
        panel_linear(x, packed.transpose(0, 1), factor, 4, 64)
    with pytest.raises(RuntimeError, match="x's 96 columns do not make 4 groups"):
        panel_linear(torch.randn(1, 96), packed, factor, 4, 64)
    with pytest.raises(RuntimeError, match="a group of 320 bytes is not"):
        panel_linear(torch.randn(1, 256), packed, factor, 4, 64)
    with pytest.raises(RuntimeError, match="bits must be 4, 5, 6 or 8"):
        torch.ops.kvforge_cpu.quant_gemm_panels(x, packed, 2, 64, factor)
    half_blocks = torch.zeros(1, 4, 3, 64 + 2 * 64, dtype=torch.uint8)  # 4-bit half blocks, an odd number of them
    with pytest.raises(RuntimeError, match="half of one of an even number of groups"):
        panel_linear(torch.randn(1, 48), half_blocks, factor, 4, 64)
    with pytest.raises(ValueError, match="parts must be at least 1"):
        pack_panels(weight.codes, weight.scales, weight.zeros, 4, parts=0)


@pytest.mark.parametrize("bits", [8, 6, 4])
@pytest.mark.parametrize("num_rows,in_features,group_size", [*HALF_BLOCK_SHAPES, (37, 128, 32)])
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 6, 64])
def test_negative_scales(bits: int, num_rows: int, in_features: int, group_size: int, num_tokens: int) -> None:
    """Scales of either sign with float zero points (GGUF's K-quants): every row gathered is the dequantized row,
    and the kernel and the reference are the product with x rounded to int8, within the tolerance of the weight with
    the scales' magnitudes."""
    magnitudes = _weight(num_rows, in_features, bits, group_size, "float", seed=num_rows + bits)
    weight = _signed(magnitudes, seed=num_rows)
    packed = pack_panels(weight.codes, weight.scales, weight.zeros, bits, parts=2)
    ids = torch.arange(num_rows)
    error = (panel_rows(*packed, bits, ids, in_features).double() - weight.dequantize().double()).abs()
    scales, zeros = (t.double().repeat_interleave(group_size, dim=1) for t in (magnitudes.scales, weight.zeros))
    assert (error <= 2**-11 * (weight.codes.double() + zeros.abs()) * scales + 1e-6).all()
    x = torch.randn(num_tokens, in_features, generator=torch.Generator().manual_seed(num_tokens)) * 3
    x[0, 16:32] = 0  # the second half of a block zero: its sum of x is 0, the first half's is not
    reference = int8_rows(x).double() @ weight.dequantize().double().t()
    tolerance = _tolerance(int8_rows(x), magnitudes, "panels")
    assert ((panel_linear_ref(x, *packed, bits, num_rows) - reference).abs() <= tolerance).all()
    error = (panel_linear(x, *packed, bits, num_rows).double() - reference).abs()
    assert (error <= tolerance).all(), error.max().item()


@pytest.mark.parametrize("bits", [8, 6, 4])
@pytest.mark.parametrize("num_rows,in_features,group_size", [(37, 128, 32), (13, 576, 192), (110, 576, 32),
                                                             *HALF_BLOCK_SHAPES])
@pytest.mark.parametrize("zeros", ["sym", "float"])
@pytest.mark.parametrize("parts", [1, 3])
def test_the_extension_packs_the_reference_layout(bits: int, num_rows: int, in_features: int, group_size: int,
                                                  zeros: str, parts: int) -> None:  # fmt: skip
    weight = _signed(_weight(num_rows, in_features, bits, group_size, zeros, seed=num_rows), seed=parts)
    packed, factor = pack_panels(weight.codes, weight.scales, weight.zeros, bits, parts=parts)
    expected, expected_factor = pack_panels_ref(weight.codes, weight.scales, weight.zeros, bits, parts=parts)
    assert factor == expected_factor and packed.shape == expected.shape and packed.stride() == expected.stride()
    whole = (parts, packed.stride(0)), (packed.stride(0), 1)  # each part with its padding
    assert torch.equal(packed.as_strided(*whole), expected.as_strided(*whole))


@pytest.mark.parametrize("bits", [8, 6, 4])
@pytest.mark.parametrize("zeros", ["sym", "float"])
def test_row_shards_pack_as_their_stack_into_an_arena(bits: int, zeros: str) -> None:
    """A merged layer's shards (q in groups of 32, k and v in groups of 16: their own rows, scales and zero points)
    packed as they are, straight into a PanelArena, hold the bytes of the reference's layout of the stacked weight;
    the next weight lies right after each part, and one that does not fit gets memory of its own."""
    shards = [_signed(_weight(num_rows, 128, bits, group_size, zeros, seed=num_rows), seed=bits)
              for num_rows, group_size in ((40, 32), (13, 16), (30, 16))]
    stacked = [torch.cat([shard.codes for shard in shards])]
    for name in ("scales", "zeros"):
        stacked.append(torch.cat([getattr(shard, name).repeat_interleave(8 // getattr(shard, name).shape[1], dim=1)
                                  for shard in shards]))
    expected, expected_factor = pack_panels_ref(*stacked, bits, parts=2)
    part_bytes = expected.stride(0)
    arena = PanelArena(2, 1 << 20, huge_pages=False)
    first, factor = pack_panels(*([getattr(s, name) for s in shards] for name in ("codes", "scales", "zeros")), bits,
                                parts=2, place=arena.place)
    assert factor == expected_factor and first.shape == expected.shape and first.stride()[1:] == expected.stride()[1:]
    assert torch.equal(first.as_strided((2, part_bytes), (arena.region, 1)),
                       expected.as_strided((2, part_bytes), (part_bytes, 1)))
    second, _ = pack_panels(*stacked, bits, parts=2, place=arena.place)
    assert first.stride(0) == second.stride(0) == arena.region
    assert second.data_ptr() == first.data_ptr() + part_bytes  # right after it, in each region
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    assert torch.equal(panel_linear(x, second, factor, bits, 83), panel_linear(x, first, factor, bits, 83))
    full = PanelArena(2, 1, huge_pages=False)
    full.place(2, full.region)
    apart, _ = pack_panels(*stacked, bits, parts=2, place=full.place)
    assert apart.stride(0) == part_bytes
    assert torch.equal(panel_linear(x, apart, factor, bits, 83), panel_linear(x, first, factor, bits, 83))


def test_panel_factors_of_shards() -> None:
    """The extension's symmetric test and largest scale or offset over every shard, as the reference takes them."""
    scales = [torch.tensor([[0.5, -3.0]]), torch.tensor([[2.0]])]
    assert torch.ops.kvforge_cpu.panel_factors(scales, [torch.full((1, 2), 8.0), torch.full((1, 1), 8.0)], 4) == (
        True, 3.0)
    assert torch.ops.kvforge_cpu.panel_factors(scales, [torch.full((1, 2), 8.0), torch.full((1, 1), -4.0)], 4) == (
        False, 24.0)


def _q6_k(num_rows: int, in_features: int, largest: int, seed: int) -> QuantizedWeight:
    """6-bit codes in groups of 16 whose scales are int8 sc times a half d a super-block of 256 columns (GGUF's
    Q6_K): each super-block's largest |sc| is `largest` (llama.cpp's quantizer: -128), d of either sign."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 64, (num_rows, in_features), generator=generator, dtype=torch.uint8)
    sc = torch.randint(-abs(largest) + 1, abs(largest), (num_rows, in_features // 16), generator=generator).float()
    sc[:, ::16] = largest
    sc[1, :16] = 0  # a super-block of zero scales
    d = (torch.rand(num_rows, in_features // SUPER_BLOCK, 1, generator=generator) * 2e-3 - 1e-3).half().float()
    scales = (sc.reshape(num_rows, -1, 16) * d).reshape(num_rows, -1)
    return QuantizedWeight(codes, scales, torch.full_like(scales, 32.0), 6)


@pytest.mark.parametrize("num_rows,in_features,largest,parts", [(17, 256, -128, 1), (100, 512, 127, 3),
                                                                (37, 768, -128, 2)])
def test_super_blocks_keep_the_int8_sub_block_scales(num_rows: int, in_features: int, largest: int,
                                                     parts: int) -> None:  # fmt: skip
    """A Q6_K weight packs as super-blocks (0.83 bytes a weight where half scales take 0.88), the reference's bytes;
    its rows are the weight; the kernel is x rounded to int8 per 256 columns times the weight, on every step shape;
    and a row of x gets the same bits alone as among 150 (the AMX path where the CPU has it)."""
    weight = _q6_k(num_rows, in_features, largest, seed=num_rows)
    packed, factor = pack_panels(weight.codes, weight.scales, weight.zeros, 6, parts=parts)
    assert packed.shape[2:] == (in_features // SUPER_BLOCK, SUPER_HEADER + 6 * 2 * SUPER_BLOCK)
    reference_bytes = pack_panels_ref(weight.codes, weight.scales, weight.zeros, 6, parts=parts)
    assert torch.equal(packed.contiguous(), reference_bytes[0].contiguous()) and factor == reference_bytes[1] == 1.0
    ids = torch.tensor([num_rows - 1, 0, 1, num_rows // 2])
    assert torch.equal(panel_rows(packed, factor, 6, ids, in_features), weight.dequantize()[ids])
    x = torch.randn(150, in_features, generator=torch.Generator().manual_seed(parts)) * 3
    x[0, :SUPER_BLOCK] = 0  # a super-block of zeros: dx = 0
    x[2, 5] = 300.0  # an outlier: the rest of its super-block rounds coarsely
    magnitudes = QuantizedWeight(weight.codes, weight.scales.abs(), weight.zeros, 6)
    for rows in (x[:1], x[:3], x[:6], x[:70]):
        reference = int8_rows(rows, SUPER_BLOCK).double() @ weight.dequantize().double().t()
        error = (panel_linear(rows, packed, factor, 6, num_rows).double() - reference).abs()
        assert (error <= _tolerance(int8_rows(rows, SUPER_BLOCK), magnitudes)).all(), error.max().item()
    alone = torch.cat([panel_linear(row[None], packed, factor, 6, num_rows) for row in x])
    assert torch.equal(panel_linear(x, packed, factor, 6, num_rows), alone)


def test_scales_of_no_int8_factors_keep_half_scales() -> None:
    """6-bit codes in groups of 16 whose scales are not int8 times one float a super-block keep a half each."""
    weight = _signed(_weight(33, 256, 6, 16, "sym", seed=1), seed=1)
    packed, factor = pack_panels(weight.codes, weight.scales, weight.zeros, 6)
    assert packed.shape[2:] == (16, 32 + 6 * 32)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    reference = int8_rows(x).double() @ weight.dequantize().double().t()
    tolerance = _tolerance(int8_rows(x), QuantizedWeight(weight.codes, weight.scales.abs(), weight.zeros, 6), "panels")
    assert ((panel_linear(x, packed, factor, 6, 33).double() - reference).abs() <= tolerance).all()


@pytest.mark.parametrize("num_rows,in_features,group_size", [(37, 128, 32), (13, 576, 192), (110, 576, 32)])
@pytest.mark.parametrize("zeros", ["sym", "int", "float"])
@pytest.mark.parametrize("parts", [1, 3])
def test_five_bit_codes(num_rows: int, in_features: int, group_size: int, zeros: str, parts: int) -> None:
    """5-bit codes take 0.625 bytes a weight where the 6-bit layout took 0.75 (the reference's bytes); rows, products
    on every step shape and the same bits for a row alone or among 150, as the other widths."""
    weight = _weight(num_rows, in_features, 5, group_size, zeros, seed=num_rows + parts)
    packed, factor = pack_panels(weight.codes, weight.scales, weight.zeros, 5, parts=parts)
    header = 32 if zeros == "sym" else 64
    assert packed.shape[3] == header + 5 * 64 * group_size // 32
    reference_bytes = pack_panels_ref(weight.codes, weight.scales, weight.zeros, 5, parts=parts)
    assert torch.equal(packed.contiguous(), reference_bytes[0].contiguous()) and factor == reference_bytes[1]
    ids = torch.tensor([num_rows - 1, 0, num_rows // 2])
    error = (panel_rows(packed, factor, 5, ids, in_features).double() - weight.dequantize()[ids].double()).abs()
    group_scales, group_zeros = (t.double().repeat_interleave(group_size, dim=1)[ids]
                                 for t in (weight.scales, weight.zeros))
    assert (error <= 2**-11 * (weight.codes[ids].double() + group_zeros.abs()) * group_scales + 1e-6).all()
    x = torch.randn(150, in_features, generator=torch.Generator().manual_seed(parts)) * 3
    for rows in (x[:1], x[:2], x[:3], x[:6], x[:70]):
        reference = int8_rows(rows).double() @ weight.dequantize().double().t()
        error = (panel_linear(rows, packed, factor, 5, num_rows).double() - reference).abs()
        assert (error <= _tolerance(int8_rows(rows), weight, "panels")).all(), error.max().item()
    alone = torch.cat([panel_linear(row[None], packed, factor, 5, num_rows) for row in x])
    assert torch.equal(panel_linear(x, packed, factor, 5, num_rows), alone)


@pytest.mark.parametrize("qtype,num_rows,in_features,parts", [(Q.Q4_K, 17, 256, 1), (Q.Q5_K, 100, 512, 3),
                                                              (Q.Q4_K, 37, 768, 2), (Q.Q5_K, 33, 256, 2)])
def test_k_quants_keep_their_sub_block_scales_and_mins(qtype: Q, num_rows: int, in_features: int,
                                                       parts: int) -> None:  # fmt: skip
    """GGUF's Q4_K and Q5_K blocks (random bytes: 6-bit sc and m of any largest value, and row 0's first super-block
    of d = 0, whose groups the decoder gives scale 0) pack as super-blocks with mins (0.59 and 0.72 bytes a weight
    where half scales and offsets take 0.625 and 0.75), the reference's bytes; their rows are the gguf package's
    dequantization; the kernel is x rounded to int8 per 256 columns times the weight, on every step shape; and a row
    of x gets the same bits alone as among 150 (the AMX path where the CPU has it)."""
    data = random_blocks(np.random.default_rng(num_rows), qtype, (num_rows, in_features))
    weight = decode_blocks(data, qtype, (num_rows, in_features))
    bits = weight.bits
    packed, factor = pack_panels(weight.codes, weight.scales, weight.zeros, bits, parts=parts)
    assert packed.shape[2:] == (in_features // SUPER_BLOCK, MINS_HEADER + 2 * bits * SUPER_BLOCK) and factor == 1.0
    reference_bytes = pack_panels_ref(weight.codes, weight.scales, weight.zeros, bits, parts=parts)
    assert torch.equal(packed.contiguous(), reference_bytes[0].contiguous()) and reference_bytes[1] == 1.0
    expected = torch.from_numpy(dequantize(data, qtype)).reshape(num_rows, in_features)
    rows = panel_rows(packed, factor, bits, torch.arange(num_rows), in_features)
    assert (rows - expected).abs().max() <= 1e-6 * expected.abs().max()
    x = torch.randn(150, in_features, generator=torch.Generator().manual_seed(parts)) * 3
    x[0, :SUPER_BLOCK] = 0  # a super-block of zeros: dx = 0
    x[2, 5] = 300.0  # an outlier: the rest of its super-block rounds coarsely
    magnitudes = QuantizedWeight(weight.codes, weight.scales.abs(), weight.zeros, bits)
    for rows in (x[:1], x[:2], x[:3], x[:6], x[:70]):
        reference = int8_rows(rows, SUPER_BLOCK).double() @ expected.double().t()
        error = (panel_linear(rows, packed, factor, bits, num_rows).double() - reference).abs()
        assert (error <= _tolerance(int8_rows(rows, SUPER_BLOCK), magnitudes)).all(), error.max().item()
    alone = torch.cat([panel_linear(row[None], packed, factor, bits, num_rows) for row in x])
    assert torch.equal(panel_linear(x, packed, factor, bits, num_rows), alone)


def test_k_quant_scales_that_make_no_super_block_keep_half_scales() -> None:
    """A Q4_K weight one of whose scales is no longer d times an integer (one float32 ulp off) keeps a half scale and
    offset a group of 32, and still multiplies as the weight."""
    data = random_blocks(np.random.default_rng(5), Q.Q4_K, (33, 512))
    weight = decode_blocks(data, Q.Q4_K, (33, 512))
    weight.scales[7, 11] = torch.nextafter(weight.scales[7, 11], torch.tensor(1.0))
    packed, factor = pack_panels(weight.codes, weight.scales, weight.zeros, 4)
    assert packed.shape[2:] == (16, 64 + 4 * 2 * 32)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    reference = int8_rows(x).double() @ weight.dequantize().double().t()
    magnitudes = QuantizedWeight(weight.codes, weight.scales.abs(), weight.zeros, 4)
    assert ((panel_linear(x, packed, factor, 4, 33).double() - reference).abs()
            <= _tolerance(int8_rows(x), magnitudes, "panels")).all()
