"""Which linear layers a quantization applies to."""

from __future__ import annotations

from torch import nn

from kvforge.layers.linear import Linear

# Layers that stay in float, by name: the LM head (GPTQ and AWQ leave it unquantized too) and MLA's
# kv_b_proj, whose weight the absorbed decode multiplies with directly (as W_UK and W_UV).
_FLOAT_LAYERS = ("lm_head", "kv_b_proj")


def quantizable_linears(model: nn.Module, skip: tuple[str, ...] = ()) -> dict[str, Linear]:
    """name -> Linear of every layer a quantization applies to."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, Linear)
        and name.rsplit(".", 1)[-1] not in _FLOAT_LAYERS
        and not any(part in name.split(".") for part in skip)
    }
