"""The C++ weight-only kernels (csrc/quant_gemv.cpp) against x @ dequantize(W).T, alone and inside a Linear: the fp32
GEMV and the dequantizing path exactly, a Linear's int8-activation GEMV against x rounded to int8 (its own tests are
in test_quant_gemv_int8_cpu.py)."""

from __future__ import annotations

import pytest
import torch

from kvforge.kernels.cpu.extension import cpu_kernels
from kvforge.kernels.cpu.quant_gemv import (
    GEMV_MAX_TOKENS,
    layout_fits,
    native_kernels_available,
    pack_weight,
    quant_linear_cpu,
)
from kvforge.kernels.cpu.quant_panels import int8_rows, panels_available
from kvforge.layers.linear import Linear
from kvforge.quantization.linear_method import WeightOnlyMethod
from kvforge.quantization.quantized_weight import QuantizedWeight

needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="the C++ CPU kernels cannot be built here")


def _weight(num_rows: int, in_features: int, bits: int, group_size: int, zeros: str, seed: int) -> QuantizedWeight:
    """Random codes; zeros "sym" (the middle code), "int" (per-group integers) or "float" (GGUF-style minimums)."""
    gen = torch.Generator().manual_seed(seed)
    num_groups = in_features // group_size
    codes = torch.randint(0, 2**bits, (num_rows, in_features), generator=gen, dtype=torch.uint8)
    scales = torch.rand(num_rows, num_groups, generator=gen) * 0.05 + 1e-3
    if zeros == "sym":
        zero_points = torch.full((num_rows, num_groups), 2.0 ** (bits - 1))
    elif zeros == "int":
        zero_points = torch.randint(0, 2**bits, (num_rows, num_groups), generator=gen).float()
    else:
        zero_points = (torch.rand(num_rows, num_groups, generator=gen) - 0.5) * 4 * 2**bits
    return QuantizedWeight(codes, scales, zero_points, bits)


def native_layer_input(x: torch.Tensor, perm: torch.Tensor | None = None, kernel: str = "native") -> torch.Tensor:
    """x [M, K] as a layer's CPU kernel multiplies it, in x's column order: the native GEMV (up to GEMV_MAX_TOKENS
    rows) and the panel kernel (every row) round x to int8 per 32 columns of the order the codes are stored in
    (x[:, perm] with act-order); the other kernels take x itself."""
    if kernel not in ("native", "panels") or (kernel == "native" and x.shape[0] > GEMV_MAX_TOKENS):
        return x
    if perm is None:
        return int8_rows(x)
    seen = torch.empty_like(x)
    seen[:, perm] = int8_rows(x[:, perm])
    return seen


def cpu_kernel_name() -> str:
    """The kernel a weight-only layer on this machine's CPU gets when its layout fits the C++ kernels."""
    return "panels" if panels_available() else "native"


def _tolerance(x: torch.Tensor, weight: QuantizedWeight, kernel: str = "native") -> torch.Tensor:
    """fp32 rounding of the kernel's sums: a few ulps of the sum of the magnitudes of the terms it adds,
    code * scale * x and the group offsets zero * scale * x; the panel kernel's half scales and offsets move each
    term by up to 2^-11 more."""
    group = weight.group_size
    scales = weight.scales.repeat_interleave(group, dim=1)
    zeros = weight.zeros.repeat_interleave(group, dim=1)
    magnitude = x.abs().double() @ ((weight.codes.double() + zeros.abs().double()) * scales.double()).t()
    return (5e-7 + (2**-11 if kernel == "panels" else 0)) * magnitude + 1e-6


@needs_kernels
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(
    "num_rows,in_features,group_size", [(37, 128, 32), (5, 128, 64), (67, 384, 128), (13, 256, 256)]
)
@pytest.mark.parametrize("zeros", ["sym", "int", "float"])
def test_kernel_matches_the_dequantized_weight(
    bits: int, num_rows: int, in_features: int, group_size: int, zeros: str
) -> None:
    weight = _weight(num_rows, in_features, bits, group_size, zeros, seed=num_rows + bits)
    packed = pack_weight(weight.codes, weight.scales, weight.zeros, bits)
    reference_weight = weight.dequantize().double()
    for num_tokens in [*range(1, GEMV_MAX_TOKENS + 1), GEMV_MAX_TOKENS + 1, 40]:
        x = torch.randn(num_tokens, in_features, generator=torch.Generator().manual_seed(num_tokens))
        out = quant_linear_cpu(x, *packed, bits, int8_activations=False)
        assert out.shape == (num_tokens, num_rows) and out.dtype == torch.float32
        error = (out.double() - x.double() @ reference_weight.t()).abs()
        assert (error <= _tolerance(x, weight)).all(), (num_tokens, error.max().item())


@needs_kernels
def test_bfloat16_activations_give_bfloat16_outputs() -> None:
    weight = _weight(24, 128, 4, 64, "int", seed=1)
    x = torch.randn(3, 128).to(torch.bfloat16)
    out = quant_linear_cpu(x, *pack_weight(weight.codes, weight.scales, weight.zeros, 4), 4, int8_activations=False)
    reference = x.double() @ weight.dequantize().double().t()
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.double(), reference, rtol=1e-2, atol=1e-2)


def test_layouts_without_whole_blocks_are_refused() -> None:
    assert layout_fits(4, 128, 32) and layout_fits(8, 96, 32)
    assert not layout_fits(4, 96, 32)  # 4-bit blocks are 64 columns wide
    assert not layout_fits(4, 128, 16) and not layout_fits(3, 128, 32)
    weight = _weight(4, 96, 4, 32, "sym", seed=0)
    with pytest.raises(ValueError, match="no CPU layout"):
        pack_weight(weight.codes, weight.scales, weight.zeros, 4)


class _GivenWeight(WeightOnlyMethod):
    def __init__(self, weight: QuantizedWeight) -> None:
        self.weight = weight

    def to_quantized_weight(self, layer: Linear) -> QuantizedWeight:
        return self.weight


@pytest.mark.skipif(not native_kernels_available(), reason="layers pick the kernels only where they are vectorized")
@pytest.mark.parametrize("bits,group_size", [(8, 576), (8, 32), (4, 64), (4, 192)])
@pytest.mark.parametrize("act_order", [False, True])
def test_linear_runs_the_kernel_on_its_dequantized_weight(bits: int, group_size: int, act_order: bool) -> None:
    num_rows, in_features = 75, 576
    weight = _weight(num_rows, in_features, bits, group_size, "int", seed=bits)
    if act_order:
        weight.perm = torch.randperm(in_features, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(num_rows)
    layer = Linear(in_features, [num_rows], bias=True)
    layer.set_format(_GivenWeight(weight))
    layer.load_shard("bias", 0, bias)
    layer.process_weights_after_loading()
    assert layer.kernel.name == cpu_kernel_name() and not hasattr(layer, "weight")
    dequantized = weight.dequantize().double()  # input features in their original order
    kernel_weight = dequantized if weight.perm is None else dequantized[:, weight.perm]  # in the stored order
    for num_tokens in (1, 7, 16, 33):
        x = torch.randn(2, num_tokens, in_features)  # leading dims are kept
        out = layer(x)
        assert out.shape == (2, num_tokens, num_rows)
        rows = native_layer_input(x.reshape(-1, in_features), weight.perm, layer.kernel.name)  # x rounded to int8
        kernel_rows = rows if weight.perm is None else rows[:, weight.perm]  # the order the codes are stored in
        reference = kernel_rows.double() @ kernel_weight.t() + bias.double()
        error = (out.reshape(reference.shape).double() - reference).abs()
        assert (error <= _tolerance(kernel_rows, weight, layer.kernel.name)).all()


@needs_kernels
def test_batches_above_the_gemv_dequantize_tile_by_tile(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight larger than one dequantized tile (here 3 rows of 20 per tile) gives the same product."""
    from kvforge.kernels.cpu import quant_gemv as quant_gemv_cpu

    weight = _weight(20, 128, 8, 32, "int", seed=3)
    packed = pack_weight(weight.codes, weight.scales, weight.zeros, 8)
    x = torch.randn(GEMV_MAX_TOKENS + 3, 128, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(quant_gemv_cpu, "DEQUANT_TILE_BYTES", 3 * 4 * 128)
    out = quant_linear_cpu(x, *packed, 8, int8_activations=False)
    error = (out.double() - x.double() @ weight.dequantize().double().t()).abs()
    assert out.shape == (x.shape[0], 20) and (error <= _tolerance(x, weight)).all()
