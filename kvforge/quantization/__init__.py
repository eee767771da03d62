"""Quantized weights and activations at run time: formats (GPTQ, AWQ, W8A8, fp8, GGUF blocks), each a LinearFormat
of the layers (layers/linear_kernel.py) chosen from quantization/registry.py. The offline quantizers that write such
checkpoints live in kvforge.quantize."""

from __future__ import annotations

from torch import nn

from kvforge.layers.linear import Linear
from kvforge.quantization.config import QuantConfig, resolve_quant_config
from kvforge.quantization.quantizable import quantizable_linears
from kvforge.quantization.registry import checkpoint_tensors, format_entry
from kvforge.quantization.vocab_rows import quantize_vocab_rows


def quantize_model(model: nn.Module, config: QuantConfig, from_float: bool) -> None:
    """Give every quantizable Linear its format, before the checkpoint is loaded (none where the registry's entry
    leaves the linear layers float)."""
    make = format_entry(config).make
    if make is None:
        return
    weight_format = make(config, from_float)
    for layer in quantizable_linears(model, config.modules_to_not_convert).values():
        layer.set_format(weight_format)


def process_weights_after_loading(model: nn.Module) -> None:
    """Prepare the kernel of every Linear whose checkpoint tensors did not all come through its load_shard."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.process_weights_after_loading()


__all__ = [
    "QuantConfig",
    "checkpoint_tensors",
    "format_entry",
    "process_weights_after_loading",
    "quantizable_linears",
    "quantize_model",
    "quantize_vocab_rows",
    "resolve_quant_config",
]
