"""The int8-activation GEMV (csrc/quant_gemv_int8.cpp): exact against x rounded to int8 the same way in torch
(a wrong index or scale shows), and within the rounding of x of the float product x @ dequantize(W).T."""

from __future__ import annotations

import pytest
import torch

from kvforge.kernels.cpu.quant_gemv import native_kernels_available, pack_weight, quant_linear_cpu
from tests.kernels.cpu.test_quant_gemv_cpu import _tolerance, _weight, int8_rows

pytestmark = pytest.mark.skipif(not native_kernels_available(), reason="int8 activations need the AVX2 kernels")

# (rows, columns, group size): odd group counts (3, 9, 5), groups of one 32-column block, of a whole row, and
# groups that end inside a 64-column block of 4-bit codes (96).
SHAPES = [(37, 128, 32), (67, 576, 64), (13, 576, 192), (9, 192, 96), (5, 320, 64), (21, 256, 256), (40, 1536, 32)]


def _case(bits: int, num_rows: int, in_features: int, group_size: int, zeros: str, num_tokens: int):
    weight = _weight(num_rows, in_features, bits, group_size, zeros, seed=num_rows + bits)
    x = torch.randn(num_tokens, in_features, generator=torch.Generator().manual_seed(num_tokens)) * 3
    out = quant_linear_cpu(x, *pack_weight(weight.codes, weight.scales, weight.zeros, bits), bits,
                           int8_activations=True)  # fmt: skip
    assert out.shape == (num_tokens, num_rows) and out.dtype == torch.float32
    return weight, x, out


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("num_rows,in_features,group_size", SHAPES)
@pytest.mark.parametrize("zeros", ["sym", "int", "float"])
@pytest.mark.parametrize("num_tokens", [1, 3, 16])
def test_kernel_is_the_product_with_x_rounded_to_int8(
    bits: int, num_rows: int, in_features: int, group_size: int, zeros: str, num_tokens: int
) -> None:
    if bits == 4 and in_features % 64:
        pytest.skip("4-bit rows are whole 64-column blocks")
    weight, x, out = _case(bits, num_rows, in_features, group_size, zeros, num_tokens)
    rounded = int8_rows(x)
    reference = rounded.double() @ weight.dequantize().double().t()
    error = (out.double() - reference).abs()
    assert (error <= _tolerance(rounded, weight)).all(), error.max().item()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("num_rows,in_features,group_size", [(67, 576, 64), (40, 1536, 32)])
@pytest.mark.parametrize("num_tokens", [1, 16])
def test_kernel_is_within_the_rounding_of_x_of_the_float_product(
    bits: int, num_rows: int, in_features: int, group_size: int, num_tokens: int
) -> None:
    """Each element of x moves by at most dx / 2; the errors of a row's hundreds of terms mostly cancel, which
    leaves ~1% of the product (Q4_1-style fractional zero points, whose rows have a nonzero mean)."""
    weight, x, out = _case(bits, num_rows, in_features, group_size, "float", num_tokens)
    dequantized = weight.dequantize().double()
    reference = x.double() @ dequantized.t()
    error = (out.double() - reference).abs()
    step = x.reshape(num_tokens, -1, 32).abs().amax(dim=-1).repeat_interleave(32, dim=1) / 127  # dx per column
    assert (error <= (step.double() / 2) @ dequantized.abs().t() + 1e-5).all()  # the worst case, never reached
    scale = reference.abs().mean()
    assert error.mean() <= 1e-2 * scale and error.max() <= 5e-2 * scale


def test_zero_blocks_and_a_full_range_of_codes() -> None:
    """A block of x that is all zeros (dx = 0) contributes nothing; 8-bit codes 0 and 255 against q = +-127 reach
    the largest int16 pairs of the kernel (2 * 128 * 127) without saturating."""
    bits = 8
    codes = torch.tensor([[0, 255] * 64, [255] * 128, [0] * 128], dtype=torch.uint8)
    scales, zeros = torch.full((3, 4), 0.5), torch.full((3, 4), 128.0)
    x = torch.tensor([[-1.0, 1.0] * 64, [1.0] * 128])
    x[:, 32:64] = 0
    out = quant_linear_cpu(x, *pack_weight(codes, scales, zeros, bits), bits, int8_activations=True)
    weight = (codes.double() - 128) * 0.5
    torch.testing.assert_close(out.double(), x.double() @ weight.t(), rtol=1e-6, atol=1e-6)
