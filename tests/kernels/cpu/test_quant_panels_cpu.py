"""The AVX-512 VNNI panel kernel (csrc/quant_panels.cpp): against x rounded to int8 the same way in torch times the
dequantized weight, up to its half scales (a wrong lane, column or scale shows), its row gather equal to the weight,
within the rounding of x of the float product, and exact on GGUF's blocks."""

from __future__ import annotations

import pytest
import torch

from kvforge.kernels.cpu.quant_panels import (
    int8_rows,
    pack_panels,
    panel_linear,
    panel_linear_ref,
    panel_rows,
    panels_available,
)
from tests.kernels.cpu.test_quant_gemv_cpu import _tolerance, _weight

pytestmark = pytest.mark.skipif(not panels_available(), reason="the panel kernel needs AVX-512 VNNI")

# (rows, columns, group size): rows that do not fill the last panel (37, 13, 9, 75, 110), one panel, groups of one
# block, of a whole row, of three blocks (96), the default model's shapes, and 7 panels in one thread's share (a tile of
# 4 panels, one of 2 and one of 1 at one row of x).
SHAPES = [(37, 128, 32), (16, 256, 256), (13, 576, 192), (9, 192, 96), (75, 576, 64), (40, 1536, 32), (110, 576, 32)]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("num_rows,in_features,group_size", SHAPES)
@pytest.mark.parametrize("zeros", ["sym", "int", "float"])
def test_rows_of_the_layout_are_the_weight(bits: int, num_rows: int, in_features: int, group_size: int,
                                           zeros: str) -> None:  # fmt: skip
    weight = _weight(num_rows, in_features, bits, group_size, zeros, seed=num_rows)
    packed = pack_panels(weight.codes, weight.scales, weight.zeros, bits)
    ids = torch.tensor([num_rows - 1, 0, num_rows // 2, 0])
    error = (panel_rows(*packed, bits, ids).double() - weight.dequantize()[ids].double()).abs()
    group_size = in_features // weight.scales.shape[1]
    scales, zeros = (t.double().repeat_interleave(group_size, dim=1)[ids] for t in (weight.scales, weight.zeros))
    terms = (weight.codes[ids].double() + zeros.abs()) * scales  # half scales and offsets: 2^-11 of each
    assert (error <= 2**-11 * terms + 1e-6).all()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("num_rows,in_features,group_size", SHAPES)
@pytest.mark.parametrize("zeros", ["sym", "int", "float"])
@pytest.mark.parametrize("num_tokens", [1, 3, 6, 64])
def test_kernel_is_the_product_with_x_rounded_to_int8(
    bits: int, num_rows: int, in_features: int, group_size: int, zeros: str, num_tokens: int
) -> None:
    """Every tile shape (4 rows of x and the 1-3 left over, one or two panels) and the partial last panel."""
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


@pytest.mark.parametrize("bits", [8, 4])
def test_kernel_is_within_the_rounding_of_x_of_the_float_product(bits: int) -> None:
    """Each element of x moves by at most dx / 2; the errors of a row's terms mostly cancel."""
    weight = _weight(96, 576, bits, 32, "float", seed=bits)
    x = torch.randn(20, 576, generator=torch.Generator().manual_seed(0))
    out = panel_linear(x, *pack_panels(weight.codes, weight.scales, weight.zeros, bits), bits, 96)
    reference = x.double() @ weight.dequantize().double().t()
    error = (out.double() - reference).abs()
    scale = reference.abs().mean()
    assert error.mean() <= 1e-2 * scale and error.max() <= 5e-2 * scale


def test_full_range_codes_and_activations() -> None:
    """8-bit codes 0 and 255 against q = +-127 (the largest int32 sums a block adds), bfloat16 in and out."""
    codes = torch.tensor([[0, 255] * 64, [255] * 128, [0] * 128], dtype=torch.uint8)
    scales, zeros = torch.full((3, 4), 0.5), torch.full((3, 4), 128.0)
    x = torch.tensor([[-1.0, 1.0] * 64, [1.0] * 128], dtype=torch.bfloat16)
    out = panel_linear(x, *pack_panels(codes, scales, zeros, 8), 8, 3)
    assert out.dtype == torch.bfloat16
    weight = (codes.double() - 128) * 0.5
    torch.testing.assert_close(out.double(), x.double() @ weight.t(), rtol=1e-2, atol=1e-6)


def test_layouts_without_whole_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="no panel layout"):
        pack_panels(torch.zeros(16, 48, dtype=torch.uint8), torch.ones(16, 1), torch.zeros(16, 1), 8)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("num_tokens", [1, 5])
@pytest.mark.parametrize("next_shape", [(16, 128), (300, 1536), (2000, 576)])
def test_prefetching_the_next_weight_changes_no_result(bits: int, num_tokens: int, next_shape: tuple[int, int]) -> None:
    """The next weight smaller than one thread's part, about the size of this one's, and larger; of the other
    width; the prefetches run past the end of each thread's part of this weight into its part of the next."""
    weight = _weight(110, 576, bits, 32, "float", seed=bits)
    packed = pack_panels(weight.codes, weight.scales, weight.zeros, bits)
    following = _weight(*next_shape, 4, 32, "int", seed=1)
    next_codes, next_scales, next_offsets, _ = pack_panels(following.codes, following.scales, following.zeros, 4)
    x = torch.randn(num_tokens, 576, generator=torch.Generator().manual_seed(0))
    alone = panel_linear(x, *packed, bits, 110)
    assert torch.equal(panel_linear(x, *packed, bits, 110, (next_codes, next_scales, next_offsets)), alone)


def test_a_next_weight_needs_all_of_its_layout() -> None:
    weight = _weight(32, 128, 4, 32, "int", seed=0)
    codes, scales, offsets, factor = pack_panels(weight.codes, weight.scales, weight.zeros, 4)
    x = torch.randn(1, 128)
    with pytest.raises(RuntimeError, match="needs its codes, scales and offsets"):
        torch.ops.kvforge_cpu.quant_gemm_panels(x, codes, scales, offsets, 4, 32, factor, codes, None, None)
    with pytest.raises(RuntimeError, match="next_scales and next_offsets must be"):
        panel_linear(x, codes, scales, offsets, factor, 4, 32, (codes, scales.float(), offsets))
