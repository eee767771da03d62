"""GGUF block formats kept quantized (`quantization="gguf"`): the linear-layer tensors of every block type
with one scale per 32 columns (KEPT_TYPES: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q4_K, Q5_K, IQ4_XS)
become QuantizedWeights as they are, decoded by kvforge.quantization.gguf_blocks without a detour
through float, and run on the weight-only kernels.

NOTE: Q6_K, Q3_K and Q2_K decode too, but with one scale per 16 columns, which a GGUFMethod layer
(GGUF_GROUP_SIZE columns per scale) does not hold: their layers are dequantized.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvforge.quantization import quantizable_linears
from kvforge.quantization.gguf_blocks import BLOCK_LAYOUTS
from kvforge.quantization.linear_method import WeightOnlyMethod, drop_parameters
from kvforge.quantization.quantized_weight import QuantizedWeight

if TYPE_CHECKING:
    from kvforge.layers.linear import Linear

logger = logging.getLogger(__name__)

GGUF_GROUP_SIZE = 32
_VOCAB_NAMES = ("model.embed_tokens.weight", "lm_head.weight")
# GGUF type kept quantized -> bits of its codes.
KEPT_TYPES = {qtype: layout.bits for qtype, layout in BLOCK_LAYOUTS.items() if layout.group_size == GGUF_GROUP_SIZE}
# The tensors a GGUFMethod layer loads in place of `weight`: name -> dtype; all [N, ...], rows first.
GGUF_TENSORS = {"codes": torch.uint8, "scales": torch.float32, "zeros": torch.float32}


class GGUFMethod(WeightOnlyMethod):
    """A Linear whose checkpoint shards are all kept GGUF blocks: it loads their codes [N, K], scales
    [N, K / 32] and zero points [N, K / 32]. bits is 8 when any shard has 8-bit codes (4-bit codes fit,
    as they are, in an 8-bit layer), else 4."""

    def __init__(self, bits: int) -> None:
        self.bits = bits

    def create_weights(self, layer: Linear) -> None:
        if layer.in_features % GGUF_GROUP_SIZE:
            raise ValueError(f"in_features {layer.in_features} is not a multiple of {GGUF_GROUP_SIZE}")
        drop_parameters(layer, "weight")
        widths = {"codes": layer.in_features, "scales": layer.in_features // GGUF_GROUP_SIZE}
        widths["zeros"] = widths["scales"]
        for name, dtype in GGUF_TENSORS.items():
            tensor = torch.zeros(layer.out_features, widths[name], dtype=dtype, device=layer.param_device)
            layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))

    def checkpoint_axes(self, param_name: str) -> tuple[int | None, int | None] | None:
        return (0, 1) if param_name in GGUF_TENSORS else None

    def to_quantized_weight(self, layer: Linear) -> QuantizedWeight:
        return QuantizedWeight(layer.codes.data, layer.scales.data, layer.zeros.data, self.bits)


def _layer_and_shard(model: nn.Module, name: str) -> tuple[str, int]:
    """The Linear (module name) and shard a checkpoint weight loads into, by the model's merged names."""
    name = name.removeprefix("model.")
    for fragment, (merged, shard) in getattr(model, "merged_params", {}).items():
        if fragment in name:
            return name.replace(fragment, merged).rsplit(".", 1)[0], shard
    return name.rsplit(".", 1)[0], 0


def keep_gguf_quantized(
    model: nn.Module, dense: Mapping[str, torch.Tensor], kept: dict[str, QuantizedWeight], vocab: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Give a GGUFMethod to every quantizable Linear whose checkpoint weights are all in kept (HF weight
    name -> QuantizedWeight); returns the tensors to load: `codes`/`scales`/`zeros` for those layers,
    and float weights for the others (dense ones, and kept ones that share a layer with a dense shard:
    dequantized here, so Q4_1 ones differ from gguf's values by float32 rounding). vocab: the embedding and
    LM head stay quantized too (else they are dequantized)."""
    linears = quantizable_linears(model)
    shards_of: dict[str, dict[int, str]] = {}
    kept_names = _keep_vocab_quantized(model, kept) if vocab else set()
    for name in kept.keys() - kept_names:
        layer_name, shard = _layer_and_shard(model, name)
        shards_of.setdefault(layer_name, {})[shard] = name
    for layer_name, shards in shards_of.items():
        layer = linears.get(layer_name)
        if layer is None or len(shards) != len(layer.shard_sizes):
            continue
        layer.set_quant_method(GGUFMethod(max(kept[name].bits for name in shards.values())))
        kept_names.update(shards.values())
    if len(kept_names) < len(kept):
        logger.info("%d GGUF tensors share a layer with float ones and are dequantized", len(kept) - len(kept_names))
    return _checkpoint_tensors(dense, kept, kept_names, kept_names & set(_VOCAB_NAMES))


def _keep_vocab_quantized(model: nn.Module, kept: dict[str, QuantizedWeight]) -> set[str]:
    """The embedding and LM head take their kept tensors as they are (a tied head is the embedding, or under
    pipeline parallelism a copy of it on the last stage); returns the names taken. A stage without the
    module skips its tensor."""
    embed, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    tied = model.config.tie_word_embeddings
    targets = {_VOCAB_NAMES[0]: [embed, head if tied and head is not embed else None],
               _VOCAB_NAMES[1]: [None if tied else head]}
    taken = set()
    for name, modules in targets.items():
        if name in kept:
            for module in modules:
                if module is not None:
                    module.load_quantized(kept[name])
            taken.add(name)
    return taken


def _checkpoint_tensors(
    dense: Mapping[str, torch.Tensor], kept: dict[str, QuantizedWeight], kept_names: set[str], installed: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """installed: kept tensors already in their modules (the vocabulary ones), not loaded again."""
    yield from dense.items()
    for name, weight in kept.items():
        if name in installed:
            continue
        if name not in kept_names:
            yield name, weight.dequantize()
            continue
        prefix = name.removesuffix(".weight")
        yield f"{prefix}.codes", weight.codes
        yield f"{prefix}.scales", weight.scales
        yield f"{prefix}.zeros", weight.zeros
