"""GGUF block formats kept quantized (a .gguf file by default, or `quantization="gguf"`): the linear-layer tensors
of every block type in kvforge.quantization.gguf_blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K .. Q6_K,
IQ4_XS) become QuantizedWeights as they are, decoded without a detour through float, and run on the weight-only
kernels: 4-bit codes, 6-bit ones for the 5- and 6-bit types, 8-bit ones for Q8_0 and the IQ4 types (whose codes
are a table's int8 values), in groups of 32 or 16 columns; so do the routed experts of an MoE layer on the CPU
(kept_experts.py). The F16 and BF16 ones keep their 16 bits
(`keep_16bit`: the layers' float weight in that dtype, which kernels/cpu/half_gemv.py multiplies).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvforge.layers.float_linear import FloatFormat
from kvforge.quantization.gguf_blocks import BlockLayout
from kvforge.quantization.kept_experts import keep_experts_quantized
from kvforge.quantization.linear_method import WeightOnlyMethod, drop_parameters
from kvforge.quantization.quantizable import quantizable_linears
from kvforge.quantization.quantized_weight import QuantizedWeight, RowShards
from kvforge.quantization.vocab_rows import load_quantized_rows

if TYPE_CHECKING:
    from kvforge.layers.linear import Linear

logger = logging.getLogger(__name__)

GGUF_GROUP_SIZE = 32  # columns of a GGUF block (or a K-quant's sub-block), whose multiples a layer's rows are
_VOCAB_NAMES = ("model.embed_tokens.weight", "lm_head.weight")
# The tensors a GGUFMethod layer loads in place of `weight`: name -> dtype; all [N, ...], rows first.
GGUF_TENSORS = {"codes": torch.uint8, "scales": torch.float32, "zeros": torch.float32}


class GGUFMethod(WeightOnlyMethod):
    """A Linear whose checkpoint shards are all kept GGUF blocks: it loads their codes [N, K], scales
    [N, K / group_size] and zero points [N, K / group_size]. bits is the widest of the shards' codes, group_size the
    smallest of the shards' groups (16 or 32): the layer's shape. A merged layer (q, k, v; gate, up) keeps its shards'
    tensors as they are, RowShards, each in its own width (shard_bits, one per shard; default: all `bits`), so that
    the kernel packs them without a copy into one tensor, and shards of different widths or groups (a Q4_K_M file's
    Q4_K q and k beside a Q6_K v) get a kernel per run of them (shard_runs.py) rather than the widest codes in the
    narrowest groups; one GGUFMethod per layer (keep_gguf_quantized gives each its own)."""

    def __init__(self, bits: int, group_size: int = GGUF_GROUP_SIZE, shard_bits: tuple[int, ...] = ()) -> None:
        self.bits, self.group_size, self.shard_bits = bits, group_size, shard_bits
        self._shards: dict[tuple[str, int], torch.Tensor] = {}  # (tensor name, shard) -> a merged layer's tensor

    def create_weights(self, layer: Linear) -> None:
        if layer.in_features % GGUF_GROUP_SIZE:
            raise ValueError(f"in_features {layer.in_features} is not a multiple of {GGUF_GROUP_SIZE}")
        drop_parameters(layer, "weight")
        widths = {"codes": layer.in_features, "scales": layer.in_features // self.group_size}
        widths["zeros"] = widths["scales"]
        for name, dtype in GGUF_TENSORS.items():
            tensor = torch.empty(layer.out_features, widths[name], dtype=dtype, device=layer.param_device)
            layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))

    def load_shard(self, layer: Linear, param_name: str, shard: int, tensor: torch.Tensor) -> bool:
        if param_name not in GGUF_TENSORS or tensor.dim() != 2:
            return False
        param = getattr(layer, param_name)
        if len(layer.shard_sizes) > 1:
            width = param.shape[1]
            if tensor.shape[0] != layer.shard_sizes[shard] or tensor.shape[1] > width or width % tensor.shape[1]:
                raise ValueError(f"checkpoint {param_name} of shape {tuple(tensor.shape)} does not fit shard {shard} "
                                 f"of shape {(layer.shard_sizes[shard], width)}")
            self._shards[param_name, shard] = tensor.to(param.dtype)
            return True
        whole = tensor.untyped_storage().nbytes() == tensor.nbytes  # not a view into a larger tensor
        if whole and tensor.shape == param.shape and tensor.dtype == param.dtype:
            param.data = tensor  # NOTE: a layer of one shard takes the decoded tensor as it is, without a copy
        else:
            layer.load_into(param_name, shard, tensor)
        return True

    def checkpoint_axes(self, param_name: str) -> tuple[int | None, int | None] | None:
        return (0, 1) if param_name in GGUF_TENSORS else None

    def to_quantized_weight(self, layer: Linear) -> QuantizedWeight | RowShards:
        if len(layer.shard_sizes) == 1:
            return QuantizedWeight(layer.codes.data, layer.scales.data, layer.zeros.data, self.bits)
        bits = self.shard_bits or (self.bits,) * len(layer.shard_sizes)
        shards = [QuantizedWeight(*(self._shards.pop((name, shard)) for name in GGUF_TENSORS), bits[shard])
                  for shard in range(len(layer.shard_sizes))]
        return RowShards(shards, self.bits, self.group_size)


def _layer_and_shard(model: nn.Module, name: str) -> tuple[str, int]:
    """The Linear (module name) and shard a checkpoint weight loads into, by the model's merged names."""
    name = name.removeprefix("model.")
    for fragment, (merged, shard) in getattr(model, "merged_params", {}).items():
        if fragment in name:
            return name.replace(fragment, merged).rsplit(".", 1)[0], shard
    return name.rsplit(".", 1)[0], 0


def keep_gguf_quantized(
    model: nn.Module, dense: Mapping[str, torch.Tensor], kept: Mapping[str, QuantizedWeight],
    layouts: dict[str, BlockLayout], vocab: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Give a GGUFMethod to every quantizable Linear whose checkpoint weights are all in kept (HF weight
    name -> QuantizedWeight, decoded when read; layouts: each one's block layout); returns the tensors to
    load, one at a time: `codes`/`scales`/`zeros` for those layers, and float weights for the others (dense ones,
    and kept ones that share a layer with a dense shard: dequantized here, so Q4_1 ones differ from gguf's values
    by float32 rounding). vocab: the embedding and LM head stay quantized too (else they are dequantized)."""
    linears = quantizable_linears(model)
    shards_of: dict[str, dict[int, str]] = {}
    kept_names = _keep_vocab_quantized(model, kept) if vocab else set()
    kept_names |= keep_experts_quantized(model, kept, layouts)
    for name in layouts.keys() - kept_names:
        layer_name, shard = _layer_and_shard(model, name)
        shards_of.setdefault(layer_name, {})[shard] = name
    for layer_name, shards in shards_of.items():
        layer = linears.get(layer_name)
        if layer is None or len(shards) != len(layer.shard_sizes):
            continue
        shard_bits = tuple(layouts[shards[shard]].bits for shard in range(len(shards)))
        group_size = min(layouts[name].group_size for name in shards.values())
        layer.set_format(GGUFMethod(max(shard_bits), group_size, shard_bits))
        kept_names.update(shards.values())
    if len(kept_names) < len(layouts):
        logger.info("%d GGUF tensors share a layer with float ones and are dequantized",
                    len(layouts) - len(kept_names))
    installed = {name for name in kept_names if name in _VOCAB_NAMES or ".experts." in name}
    return _checkpoint_tensors(dense, kept, kept_names, installed)


def keep_16bit(model: nn.Module, half_dtypes: Mapping[str, torch.dtype], vocab: bool = True) -> None:
    """Before loading: every quantizable Linear whose checkpoint weights are all kept in one 16-bit dtype (half_dtypes:
    HF weight name -> float16 or bfloat16, a GGUF file's F16 and BF16 matrices) gets its float weight in that dtype,
    unwritten, which loading fills as stored; vocab: the embedding and LM head too. A layer whose shards differ
    (a 16-bit one beside a kept block type or another dtype) keeps its float weight, and loading widens them."""
    linears = quantizable_linears(model)
    shards_of: dict[str, dict[int, torch.dtype]] = {}
    for name in half_dtypes.keys() - set(_VOCAB_NAMES):
        layer_name, shard = _layer_and_shard(model, name)
        shards_of.setdefault(layer_name, {})[shard] = half_dtypes[name]
    widened = 0
    for layer_name, shards in shards_of.items():
        layer = linears.get(layer_name)
        if (layer is not None and isinstance(layer.format, FloatFormat) and len(shards) == len(layer.shard_sizes)
                and len(set(shards.values())) == 1):
            _in_dtype(layer, shards[0])
        else:
            widened += len(shards)
    if widened:
        logger.warning("%d F16/BF16 weights share a layer with weights of another type: widened to the model's float "
                       "type", widened)
    for name, modules in _vocab_targets(model).items():
        if vocab and name in half_dtypes:
            for module in modules:
                if module is not None:
                    _in_dtype(module, half_dtypes[name])


def _in_dtype(module: nn.Module, dtype: torch.dtype) -> None:
    """The module's float weight replaced by an unwritten one of the same shape in dtype."""
    weight = module.weight
    module.weight = nn.Parameter(torch.empty(weight.shape, dtype=dtype, device=weight.device), requires_grad=False)


def _vocab_targets(model: nn.Module) -> dict[str, list[nn.Module | None]]:
    """HF vocabulary tensor name -> the modules that take it: a tied head is the embedding, or under pipeline
    parallelism a copy of it on the last stage; a stage without the module has None."""
    embed, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    tied = model.config.tie_word_embeddings
    return {_VOCAB_NAMES[0]: [embed, head if tied and head is not embed else None],
            _VOCAB_NAMES[1]: [None if tied else head]}


def _keep_vocab_quantized(model: nn.Module, kept: Mapping[str, QuantizedWeight]) -> set[str]:
    """The embedding and LM head take their kept tensors as they are; returns the names taken. A stage without the
    module skips its tensor."""
    taken = set()
    for name, modules in _vocab_targets(model).items():
        if name in kept and any(module is not None for module in modules):
            weight = kept[name]
            for module in modules:
                if module is not None:
                    load_quantized_rows(module, weight)
            taken.add(name)
        elif name in kept:
            taken.add(name)
    return taken


def _checkpoint_tensors(
    dense: Mapping[str, torch.Tensor], kept: Mapping[str, QuantizedWeight], kept_names: set[str], installed: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """installed: kept tensors already in their modules (the vocabulary ones), not loaded again."""
    yield from dense.items()
    for name in kept:
        if name in installed:
            continue
        weight = kept[name]
        if name not in kept_names:
            yield name, weight.dequantize()
            continue
        prefix = name.removesuffix(".weight")
        yield f"{prefix}.codes", weight.codes
        yield f"{prefix}.scales", weight.scales
        yield f"{prefix}.zeros", weight.zeros
