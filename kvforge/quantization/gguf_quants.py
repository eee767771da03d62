"""GGUF block formats kept quantized (`quantization="gguf"`): the Q8_0, Q4_0 and Q4_1 tensors of linear
layers become QuantizedWeights as they are, without a detour through float, and run on the weight-only
kernels.

Each row of K weights is cut into blocks of 32, each led by its float16 parameters:

    Q8_0  [d: f16][q: 32 x int8]                      w = d * q
    Q4_0  [d: f16][16 bytes of nibbles]               w = d * (q - 8)
    Q4_1  [d: f16][m: f16][16 bytes of nibbles]       w = d * q + m
          byte j holds q[j] in its low nibble and q[j + 16] in its high nibble

A block is a group of 32 of a QuantizedWeight, W = (codes - zeros) * scales, with scales = d and

    Q8_0  codes = q + 128 (as uint8), zeros = 128
    Q4_0  codes = q,                  zeros = 8
    Q4_1  codes = q,                  zeros = -m / d   (a float zero point, not an integer)

Q8_0 and Q4_0 dequantize to gguf's values bit for bit; Q4_1 to within float32 rounding, because
(q + m / d) * d rounds three times where d * q + m rounds twice.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from kvforge.quantization import quantizable_linears
from kvforge.quantization.linear_method import WeightOnlyMethod, drop_parameters
from kvforge.quantization.quantized_weight import QuantizedWeight

if TYPE_CHECKING:
    from kvforge.layers.linear import Linear

logger = logging.getLogger(__name__)

GGUF_GROUP_SIZE = 32
_VOCAB_NAMES = ("model.embed_tokens.weight", "lm_head.weight")
# GGUF type kept quantized -> bits of its codes.
KEPT_TYPES = {GGMLQuantizationType.Q8_0: 8, GGMLQuantizationType.Q4_0: 4, GGMLQuantizationType.Q4_1: 4}
# The tensors a GGUFMethod layer loads in place of `weight`: name -> dtype; all [N, ...], rows first.
GGUF_TENSORS = {"codes": torch.uint8, "scales": torch.float32, "zeros": torch.float32}


def _half_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 at byte offset of every block [N, G, block_bytes], as float32 [N, G]."""
    return np.ascontiguousarray(blocks[..., offset : offset + 2]).view(np.float16)[..., 0].astype(np.float32)


def decode_blocks(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> QuantizedWeight:
    """The raw blocks of a Q8_0 / Q4_0 / Q4_1 tensor of shape [N, K] as a QuantizedWeight (lossless)."""
    if qtype not in KEPT_TYPES:
        raise ValueError(f"GGUF type {qtype.name} is not kept quantized; kept: {[t.name for t in KEPT_TYPES]}")
    num_rows, in_features = shape
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    if (
        block_size != GGUF_GROUP_SIZE
        or in_features % block_size
        or data.nbytes != num_rows * (in_features // block_size) * block_bytes
    ):
        raise ValueError(f"{data.nbytes} bytes of {qtype.name} blocks do not hold a {num_rows}x{in_features} matrix")
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(num_rows, -1, block_bytes)  # [N, G, bytes]
    scales = _half_field(blocks, 0)  # [N, G]
    if qtype == GGMLQuantizationType.Q8_0:
        codes = blocks[..., 2:] ^ np.uint8(0x80)  # int8 q -> q + 128
        zeros = np.full_like(scales, 128)
    else:
        nibbles = blocks[..., -16:]
        codes = np.concatenate([nibbles & np.uint8(0x0F), nibbles >> np.uint8(4)], axis=-1)  # [N, G, 32]
        if qtype == GGMLQuantizationType.Q4_0:
            zeros = np.full_like(scales, 8)
        else:
            scales, zeros, codes = _q4_1_zero_points(scales, _half_field(blocks, 2), codes)
    return QuantizedWeight(
        torch.from_numpy(np.ascontiguousarray(codes).reshape(num_rows, in_features)),
        torch.from_numpy(np.ascontiguousarray(scales)),
        torch.from_numpy(np.ascontiguousarray(zeros)),
        KEPT_TYPES[qtype],
    )


def _q4_1_zero_points(d: np.ndarray, m: np.ndarray, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(scales, zeros, codes) of Q4_1 blocks: d * q + m = (q - (-m / d)) * d.

    NOTE: a block with d == 0 holds 32 copies of m, which no zero point of scale 0 gives back; it is
    stored as codes 0, zero -1 and scale m instead."""
    constant = d == 0
    zeros = np.where(constant, np.float32(-1), -(m / np.where(constant, np.float32(1), d)))
    codes = np.where(constant[..., None], np.uint8(0), codes)
    return np.where(constant, m, d), zeros.astype(np.float32), codes


class GGUFMethod(WeightOnlyMethod):
    """A Linear whose checkpoint shards are all kept GGUF blocks: it loads their codes [N, K], scales
    [N, K / 32] and zero points [N, K / 32]. bits is 8 when any shard is Q8_0 (4-bit codes fit, as they
    are, in an 8-bit layer), else 4."""

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
