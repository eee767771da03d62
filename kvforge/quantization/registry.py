"""The registry of weight formats: a quantization method's name (QuantConfig.method, declared in
quantization/config.py) -> its implementation of the layers' LinearFormat (layers/linear_kernel.py), and what the
loader does for it besides. The loader asks this table and never compares format names.

Adding a format is one file (its LinearFormat and kernels) plus one line here. A GGUF file's block types are each
one entry of quantization/gguf_blocks.py's BLOCK_LAYOUTS (their layout and decoder): every such layer gets a GGUFMethod
of the type's bits and groups, which the weight-only kernels run; its F16 and BF16 matrices keep the float format
(layers/float_linear.py) in their 16 bits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from kvforge.layers.linear_kernel import LinearFormat
from kvforge.quantization.config import QuantConfig
from kvforge.quantization.formats import AWQMethod, GPTQMethod
from kvforge.quantization.fp8 import Fp8Method, fp8_checkpoint_tensors
from kvforge.quantization.linear_method import RTNMethod
from kvforge.quantization.w8a8 import W8A8Method

Tensors = Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class FormatEntry:
    """make(config, from_float): the format of every quantizable Linear, from a checkpoint in this format or, with
    from_float, quantizing a float one at load time; None: the linear layers stay float (the model family reads
    the format's tensors itself). checkpoint_tensors: the checkpoint's tensors as the format loads them (a
    checkpoint in this format, not a float one). quantizes_vocab: with the quantize_lm_head option, the embedding
    and LM head are kept as int8 rows too."""

    make: Callable[[QuantConfig, bool], LinearFormat] | None
    checkpoint_tensors: Callable[[Tensors], Iterator[tuple[str, torch.Tensor]]] | None = None
    quantizes_vocab: bool = False


LINEAR_FORMATS: dict[str, FormatEntry] = {
    "rtn": FormatEntry(RTNMethod.from_config, quantizes_vocab=True),
    "gptq": FormatEntry(GPTQMethod.from_config),
    "awq": FormatEntry(AWQMethod.from_config),
    "w8a8": FormatEntry(W8A8Method.from_config),
    "fp8": FormatEntry(Fp8Method.from_config, checkpoint_tensors=fp8_checkpoint_tensors),
    "mxfp4": FormatEntry(None),  # MoE experts only, which GPT-OSS keeps in MXFP4 itself
}


def format_entry(config: QuantConfig) -> FormatEntry:
    return LINEAR_FORMATS[config.method]


def checkpoint_tensors(config: QuantConfig, from_float: bool, weights: Tensors) -> Tensors:
    """The checkpoint's tensors as config's format loads them."""
    adapt = format_entry(config).checkpoint_tensors
    return weights if from_float or adapt is None else adapt(weights)
