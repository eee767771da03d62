"""Each quantized Linear against its float reference: the error stays within the quantization step."""

from __future__ import annotations

import pytest
import torch

from kvforge.kernels.cpu import packed_gemm
from kvforge.kernels.cpu.quant_gemv import native_kernels_available
from kvforge.layers.linear import Linear
from kvforge.quantization.linear_method import RTNMethod
from kvforge.quantization.w8a8 import W8A8Method
from tests.kernels.cpu.test_quant_gemv_cpu import cpu_kernel_name


def _layer(method, weight: torch.Tensor, bias: torch.Tensor) -> Linear:
    layer = Linear(weight.shape[1], [weight.shape[0] // 2, weight.shape[0] // 2], bias=True)
    layer.set_format(method)
    half = weight.shape[0] // 2
    for shard in range(2):
        layer.load_shard("weight", shard, weight[shard * half : (shard + 1) * half])
        layer.load_shard("bias", shard, bias[shard * half : (shard + 1) * half])
    layer.process_weights_after_loading()
    return layer


@pytest.mark.parametrize("num_tokens", [1, 40])
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize(
    "bits,group_size,sym,fallback_kernel",
    [
        (8, -1, True, "int8pack"),
        (8, 32, False, "generic"),
        (4, 32, False, "int4pack"),
        (4, 64, True, "int4pack"),
        (4, -1, False, "int4pack"),
    ],
)
def test_weight_only_error_is_bounded_by_the_step(
    monkeypatch: pytest.MonkeyPatch, num_tokens: int, native: bool, bits: int, group_size: int, sym: bool,
    fallback_kernel: str,
) -> None:
    if native and not native_kernels_available():
        pytest.skip("no vectorized C++ CPU kernels here")
    if not native:  # as without a compiler, with KVFORGE_NO_CPU_EXTENSION=1, or without AVX2
        monkeypatch.setattr(packed_gemm, "native_kernels_available", lambda: False)
        monkeypatch.setattr(packed_gemm, "panels_available", lambda: False)
    torch.manual_seed(0)
    weight, bias, x = torch.randn(96, 128), torch.randn(96), torch.randn(num_tokens, 128)
    layer = _layer(RTNMethod(bits, group_size, sym), weight, bias)
    assert layer.kernel.name == (cpu_kernel_name() if native else fallback_kernel) and not hasattr(layer, "weight")
    # each weight is off by at most half a step; the step is at most range / (2**bits - 1)
    step = 2 * weight.abs().max() / (2**bits - 1)
    bound = x.abs().sum(dim=1, keepdim=True) * step / 2
    bf16_rounding = 1e-2 * (x @ weight.t()).abs() + 1e-2  # int8pack/int4pack round activations to bf16
    error = (layer(x) - (x @ weight.t() + bias)).abs()
    assert (error <= bound + bf16_rounding).all()
    assert error.mean() < 0.25 * bound.mean()  # rounding errors mostly cancel


@pytest.mark.parametrize("num_tokens", [1, 40])
def test_w8a8_error_is_bounded_by_weight_and_activation_steps(num_tokens: int) -> None:
    torch.manual_seed(0)
    weight, bias, x = torch.randn(64, 96), torch.randn(64), torch.randn(num_tokens, 96)
    layer = _layer(W8A8Method(from_float=True), weight, bias)
    w_step = weight.abs().amax(dim=1) / 127  # [N]
    x_step = x.abs().amax(dim=1, keepdim=True) / 127  # [M, 1]
    bound = (
        x.abs().sum(dim=1, keepdim=True) * w_step / 2
        + weight.abs().sum(dim=1) * x_step / 2
        + 96 * x_step * w_step / 4
    )
    error = (layer(x) - (x @ weight.t() + bias)).abs()
    assert (error <= bound * 1.05 + 1e-2 * (x @ weight.t()).abs()).all()


def test_float_linear_is_untouched() -> None:
    layer = Linear(8, [4])
    weight = torch.randn(4, 8)
    layer.load_shard("weight", 0, weight)  # the layer's last checkpoint tensor: its kernel is prepared
    assert layer.kernel.name == "float" and layer.kernel.weight is layer.weight  # the layer's own, not a copy
    x = torch.randn(2, 8)
    assert torch.equal(layer(x), x @ weight.t())
