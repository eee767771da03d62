"""fp8 (e4m3) weights: quantization error within e4m3's precision, both matmul paths against the float
reference, the GPU selection rule, and checkpoint scales as common tools write them."""

from __future__ import annotations

import pytest
import torch

from kvforge.layers.linear import Linear
from kvforge.platforms import Platform
from kvforge.quantization import fp8
from kvforge.quantization.config import QuantConfig
from kvforge.quantization.fp8 import (
    FP8_MAX,
    Fp8Method,
    dequantize_fp8,
    fp8_checkpoint_tensors,
    fp8_scaled_mm,
    quantize_fp8,
    to_fnuz,
)

# e4m3 keeps 3 mantissa bits: half a step is 2^-4 of a normal value; subnormals are 2^-9 apart.
RELATIVE_STEP, SUBNORMAL_STEP = 2.0**-4, 2.0**-9


def weight_error_bound(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return RELATIVE_STEP * weight.abs() + SUBNORMAL_STEP / 2 * scales[:, None]


def test_quantize_error_is_within_e4m3_precision() -> None:
    torch.manual_seed(0)
    weight = torch.randn(64, 96) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different ranges
    weight[5] = 0.0
    codes, scales = quantize_fp8(weight)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (64,)
    assert torch.allclose(codes.float().abs().amax(dim=1)[weight.abs().amax(dim=1) > 0], torch.tensor(FP8_MAX))
    restored = dequantize_fp8(codes, scales, torch.float32)
    assert ((restored - weight).abs() <= weight_error_bound(weight, scales)).all()
    assert torch.equal(restored[5], torch.zeros(96))


def _layer(method: Fp8Method, weight: torch.Tensor, bias: torch.Tensor) -> Linear:
    half = weight.shape[0] // 2
    layer = Linear(weight.shape[1], [half, half], bias=True)
    layer.set_format(method)
    for shard in range(2):
        layer.load_shard("weight", shard, weight[shard * half : (shard + 1) * half])
        layer.load_shard("bias", shard, bias[shard * half : (shard + 1) * half])
    layer.process_weights_after_loading()
    return layer


@pytest.mark.parametrize("kernel", ["dequant", "scaled_mm"])
@pytest.mark.parametrize("num_tokens", [1, 33])
def test_layer_matches_the_float_reference(monkeypatch, kernel: str, num_tokens: int) -> None:
    """The CPU's "dequant" path, and the fp8 GPUs' "scaled_mm" path run here on torch's CPU _scaled_mm."""
    kernels = {"dequant": fp8.Fp8DequantKernel, "scaled_mm": fp8.Fp8ScaledMMKernel}
    monkeypatch.setattr(fp8, "select_fp8_kernel", lambda *args: kernels[kernel]())
    torch.manual_seed(num_tokens)
    weight, bias, x = torch.randn(96, 128), torch.randn(96), torch.randn(num_tokens, 128)
    layer = _layer(Fp8Method(from_float=True), weight, bias)
    assert layer.kernel.name == kernel and layer.kernel.codes.dtype == torch.float8_e4m3fn
    assert not hasattr(layer, "weight")
    expected = x @ weight.t() + bias
    error = (layer(x) - expected).abs()
    magnitude = x.abs() @ weight.abs().t()
    if kernel == "dequant":  # only the weights are rounded
        bound = x.abs() @ weight_error_bound(weight, layer.kernel.scales).t() + 1e-4
    else:  # activations too, per token
        bound = 2.2 * RELATIVE_STEP * magnitude + 1e-2
    assert (error <= bound).all()
    assert error.mean() < 0.2 * bound.mean()  # rounding errors mostly cancel


def test_dequant_path_in_bfloat16() -> None:
    torch.manual_seed(0)
    weight, x = torch.randn(32, 64), torch.randn(5, 64)
    layer = Linear(64, [32])
    layer.weight.data.copy_(weight)
    layer.set_format(Fp8Method(from_float=True))
    layer.process_weights_after_loading()
    out = layer(x.bfloat16())
    assert out.dtype == torch.bfloat16
    assert ((out.float() - x @ weight.t()).abs() <= 0.1 * (x.abs() @ weight.abs().t()) + 0.05).all()


def test_scaled_mm_keeps_tokens_apart() -> None:
    """Per-token activation scales: a token of tiny values keeps its precision beside a huge one."""
    torch.manual_seed(0)
    codes, scales = quantize_fp8(torch.randn(48, 64))
    x = torch.randn(2, 64)
    x[0] *= 1e4
    weight = dequantize_fp8(codes, scales, torch.float32)
    out = fp8_scaled_mm(x, codes, scales, torch.ones(()))
    assert ((out - x @ weight.t()).abs() <= 1.1 * RELATIVE_STEP * (x.abs() @ weight.abs().t())).all()


def test_fnuz_codes_stand_for_the_same_weights() -> None:
    codes, scales = quantize_fp8(torch.randn(16, 32))
    codes.view(torch.int8)[0, :4] = -128  # e4m3fn's negative zero, NaN in fnuz
    fnuz, fnuz_scales = to_fnuz(codes, scales)
    assert fnuz.dtype == torch.float8_e4m3fnuz
    restored = dequantize_fp8(fnuz, fnuz_scales, torch.float32)
    assert torch.equal(restored, dequantize_fp8(codes, scales, torch.float32))
    assert not restored.isnan().any()


def _platform(kind: str, arch: str) -> Platform:
    return Platform(kind, "device", arch, 32, 1, 1, None)


@pytest.mark.parametrize(
    "kind,arch,supported",
    [("cuda", "sm_89", True), ("cuda", "sm_90", True), ("cuda", "sm_100", True), ("cuda", "sm_120", True),
     ("cuda", "sm_86", False), ("cuda", "sm_80", False), ("rocm", "gfx942", True), ("rocm", "gfx950", True),
     ("rocm", "gfx90a", False), ("rocm", "gfx1100", False), ("rocm", "gfx1201", True), ("cpu", "x86_64", False)],
)  # fmt: skip
def test_fp8_math_only_where_the_device_has_it(kind: str, arch: str, supported: bool) -> None:
    platform = _platform(kind, arch)
    assert platform.has_native_fp8 == supported
    assert platform.fp8_dtype == (torch.float8_e4m3fnuz if arch == "gfx942" else torch.float8_e4m3fn)


def test_cpu_layers_store_fp8_and_dequantize() -> None:
    assert fp8.select_fp8_kernel(torch.device("cpu"), 64, 64).name == "dequant"


def test_checkpoint_scales_become_per_channel_vectors() -> None:
    codes = torch.zeros(4, 8, dtype=torch.float8_e4m3fn)
    stream = [
        ("a.weight_scale", torch.tensor(0.5)),  # per tensor, before its weight
        ("a.input_scale", torch.tensor(2.0)),
        ("a.weight", codes),
        ("b.weight", codes[:3]),
        ("b.weight_scale", torch.tensor([0.25])),  # per tensor, after its weight
        ("c.weight", codes),
        ("c.weight_scale", torch.arange(4.0)[:, None]),  # per channel [N, 1]
    ]
    out = dict(fp8_checkpoint_tensors(stream))
    assert sorted(out) == ["a.weight", "a.weight_scale", "b.weight", "b.weight_scale", "c.weight", "c.weight_scale"]
    assert torch.equal(out["a.weight_scale"], torch.full((4,), 0.5))
    assert torch.equal(out["b.weight_scale"], torch.full((3,), 0.25))
    assert torch.equal(out["c.weight_scale"], torch.arange(4.0))
    with pytest.raises(ValueError, match="weight_scale without weight"):
        list(fp8_checkpoint_tensors([("d.weight_scale", torch.tensor(1.0))]))


def test_fp8_quantization_config() -> None:
    config = QuantConfig.from_hf({"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]})
    assert (config.method, config.bits, config.modules_to_not_convert) == ("fp8", 8, ("lm_head",))
    assert QuantConfig.online("fp8").method == "fp8"
    with pytest.raises(ValueError, match="block-wise"):
        QuantConfig.from_hf({"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ValueError, match="activation_scheme"):
        QuantConfig.from_hf({"quant_method": "fp8", "activation_scheme": "delayed"})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")
def test_layer_on_the_gpu() -> None:
    """fp8 math on sm_89+ / gfx942 / gfx950 (fnuz codes on gfx942), dequantized F.linear elsewhere."""
    from kvforge.platforms import current_platform

    torch.manual_seed(0)
    weight, x = torch.randn(256, 512), torch.randn(7, 512)
    layer = Linear(512, [256]).cuda().to(torch.bfloat16)
    layer.weight.data.copy_(weight)
    layer.set_format(Fp8Method(from_float=True))
    layer.process_weights_after_loading()
    supported = current_platform().has_native_fp8
    assert layer.kernel.name == ("scaled_mm" if supported else "dequant")
    out = layer(x.cuda().bfloat16()).float().cpu()
    assert ((out - x @ weight.t()).abs() <= 2.2 * RELATIVE_STEP * (x.abs() @ weight.abs().t()) + 0.05).all()
