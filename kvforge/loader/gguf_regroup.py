"""What a GGUF architecture declares for the tensors llama.cpp's converter split, merged or stacked differently from
the Hugging Face checkpoints (GPT-OSS's experts, Qwen3-Next's linear attention and experts): the layer tensor kinds it
takes over from the one-tensor-one-name mapping, and the function that gives back the checkpoint's tensors.

    regroup(file, layers, config, keep_quantized, dense) -> Regrouped
        layers    layer index -> {"<kind>.<suffix>": tensor} of the kinds declared, as the file has them ("<kind>"
                  for a tensor without a suffix)
        config    the config.json view of the file
        keep_quantized  weights of a type in BLOCK_LAYOUTS may stay in their blocks (Regrouped.quantized)
        dense     reads one GGUF tensor as a float tensor in the load's dtype
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvforge.loader.gguf_file import GGUFFile, GGUFTensor
from kvforge.quantization.gguf_blocks import BlockLayout
from kvforge.quantization.quantized_weight import QuantizedWeight

Reader = Callable[[], torch.Tensor]  # reads one checkpoint tensor when called
KeptReader = Callable[[], QuantizedWeight]  # reads one weight's quantized blocks when called
Dense = Callable[[GGUFTensor], torch.Tensor]  # a GGUF tensor read as a float one
LayerTensors = dict[int, dict[str, GGUFTensor]]


@dataclass(slots=True)
class Regrouped:
    """The checkpoint's tensors regrouped from the file's, and what they imply."""

    readers: dict[str, Reader]  # HF name -> its reader
    config: dict[str, Any] = field(default_factory=dict)  # config.json entries they imply
    kept_bytes: int = 0  # of the tensors kept in their file's quantized type
    dense_numel: int = 0  # weights of the tensors read as floats
    quantized: dict[str, KeptReader] = field(default_factory=dict)  # HF weight name -> its kept blocks' reader
    layouts: dict[str, BlockLayout] = field(default_factory=dict)  # HF weight name (of `quantized`) -> block layout


@dataclass(frozen=True, slots=True)
class Regrouping:
    kinds: frozenset[str]  # the GGUF layer tensor kinds (blk.{i}.<kind>.<suffix>) it reads
    regroup: Callable[[GGUFFile, LayerTensors, dict[str, Any], bool, Dense], Regrouped]


def require(file: GGUFFile, layer: int, parts: dict[str, GGUFTensor], *names: str) -> list[GGUFTensor]:
    """The layer's tensors of these "<kind>.<suffix>" names; ValueError naming those the file lacks."""
    missing = [name for name in names if name not in parts]
    if missing:
        raise ValueError(f"{file.path}: layer {layer} has no {', '.join(missing)}")
    return [parts[name] for name in names]
