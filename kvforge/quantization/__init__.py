"""Quantized weights and activations at run time: formats (GPTQ, AWQ, W8A8, fp8, GGUF blocks) and their
linear methods. The offline quantizers that write such checkpoints live in kvforge.quantize."""

from __future__ import annotations

from torch import nn

from kvforge.layers.linear import Linear
from kvforge.quantization.config import QuantConfig, resolve_quant_config
from kvforge.quantization.formats import AWQMethod, GPTQMethod
from kvforge.quantization.fp8 import Fp8Method
from kvforge.quantization.linear_method import LinearMethod, RTNMethod
from kvforge.quantization.quantized_weight import quantize_rtn
from kvforge.quantization.w8a8 import W8A8Method

# Layers that stay in float, by name: the LM head (GPTQ and AWQ leave it unquantized too) and MLA's
# kv_b_proj, whose weight the absorbed decode multiplies with directly (as W_UK and W_UV).
_FLOAT_LAYERS = ("lm_head", "kv_b_proj")


def linear_method(config: QuantConfig, from_float: bool) -> LinearMethod:
    """The method of every quantized Linear of a model run with config."""
    if config.method == "rtn":
        return RTNMethod(config.bits, config.group_size, config.sym)
    if config.method == "w8a8":
        return W8A8Method(from_float=from_float, smoothquant=config.smoothquant)
    if config.method == "fp8":
        return Fp8Method(from_float=from_float)
    if config.method == "gptq":
        return GPTQMethod(config.bits, config.group_size, config.checkpoint_format)
    return AWQMethod(config.bits, config.group_size)


def quantizable_linears(model: nn.Module, skip: tuple[str, ...] = ()) -> dict[str, Linear]:
    """name -> Linear of every layer a quantization applies to."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, Linear)
        and name.rsplit(".", 1)[-1] not in _FLOAT_LAYERS
        and not any(part in name.split(".") for part in skip)
    }


def quantize_model(model: nn.Module, config: QuantConfig, from_float: bool) -> None:
    """Give every quantizable Linear its method, before the checkpoint is loaded. (An MXFP4 checkpoint quantizes
    only MoE experts, which its model family keeps in MXFP4 itself: its linear layers stay float.)"""
    if config.method == "mxfp4":
        return
    method = linear_method(config, from_float)
    for layer in quantizable_linears(model, config.modules_to_not_convert).values():
        layer.set_quant_method(method)


def quantize_vocab_rows(model: nn.Module) -> None:
    """The embedding and the LM head (one module when tied) as int8 codes per row with a zero point: the head
    then runs through the weight-only GEMV, and lookups dequantize only their rows."""
    modules = {id(m): m for m in (getattr(model, "embed_tokens", None), getattr(model, "lm_head", None))}
    for module in modules.values():
        if module is not None and module.kernel is None:
            module.keep_quantized(quantize_rtn(module.weight.data, 8, -1, sym=False))


def process_weights_after_loading(model: nn.Module) -> None:
    """Convert every quantized Linear's checkpoint tensors to its runtime layout."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.process_weights_after_loading()


__all__ = [
    "QuantConfig",
    "linear_method",
    "process_weights_after_loading",
    "quantizable_linears",
    "quantize_model",
    "quantize_vocab_rows",
    "resolve_quant_config",
]
