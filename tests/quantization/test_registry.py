"""The registry of weight formats and the one linear-kernel interface: every format the loader can pick, the float one
included, gives a Linear a kernel that multiplies like the float layer and reports the bytes it stores and the
FLOPs of a call (what the profiler reads)."""

from __future__ import annotations

import pytest
import torch

from kvforge.layers.float_linear import FloatFormat
from kvforge.layers.linear import Linear
from kvforge.quantization import quantize_model
from kvforge.quantization.config import METHOD_BITS, ONLINE_METHODS, QuantConfig
from kvforge.quantization.registry import LINEAR_FORMATS, format_entry


def test_every_declared_method_has_one_registry_entry():
    assert set(LINEAR_FORMATS) == set(METHOD_BITS)
    with pytest.raises(ValueError, match="'int3'"):
        QuantConfig("int3", 4)


def _loaded_layer(weight_format, weight: torch.Tensor, bias: torch.Tensor) -> Linear:
    """A merged layer (two shards) given weight_format, loaded shard by shard as a checkpoint loads it."""
    layer = Linear(weight.shape[1], [weight.shape[0] // 2] * 2, bias=True)
    if weight_format is not None:
        layer.set_format(weight_format)
    for shard, rows in enumerate(weight.chunk(2)):
        layer.load_shard("weight", shard, rows)
    for shard, rows in enumerate(bias.chunk(2)):
        layer.load_shard("bias", shard, rows)
    return layer  # NOTE: no explicit process step: the last shard in prepares the kernel


@pytest.mark.parametrize("option", [None, *ONLINE_METHODS])
def test_each_format_from_the_registry_runs_through_the_one_interface(option: str | None):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 128, generator=generator)
    bias = 20 * torch.randn(64, generator=generator)  # as large as the products: a kernel that drops it fails
    config = None if option is None else QuantConfig.online(option)
    weight_format = None if config is None else format_entry(config).make(config, True)
    layer = _loaded_layer(weight_format, weight, bias)
    kernel = layer.kernel
    assert isinstance(layer.format, FloatFormat if option is None else type(weight_format))
    x = torch.randn(2, 3, 128, generator=generator)  # leading dims are kept
    product = x @ weight.t()
    out = layer(x)
    assert out.shape == product.shape
    # the quantization step of 4-bit codes (and int8 activations where the kernel rounds them) is up to ~10%
    assert (out - (product + bias)).abs().max() <= (1e-5 if option is None else 0.15) * product.abs().max()
    float_bytes = weight.nbytes + bias.nbytes
    if config is None:
        assert kernel.weight_bytes() == float_bytes
    else:  # at least the codes, and less than the float weight
        assert weight.numel() * config.bits // 8 <= kernel.weight_bytes() < float_bytes
    assert kernel.flops(5) == 2 * 5 * 64 * 128


def test_quantize_model_asks_the_registry_and_mxfp4_leaves_linears_float():
    model = torch.nn.ModuleDict({"proj": Linear(64, [32]), "lm_head": Linear(64, [32])})
    quantize_model(model, QuantConfig("mxfp4", 4, 32), from_float=False)
    assert all(isinstance(layer.format, FloatFormat) for layer in model.values())
    quantize_model(model, QuantConfig.online("w8a8"), from_float=True)
    assert type(model["proj"].format).__name__ == "W8A8Method" and isinstance(model["lm_head"].format, FloatFormat)
