"""Routed experts stacked one tensor a projection in a GGUF file (Mixtral, Qwen2-MoE, Qwen3-MoE, Qwen3-Next, Qwen3.5
MoE), given back as the stacked tensors of the Hugging Face checkpoints (transformers >= 5):

    GGUF  blk.{i}.ffn_gate_exps [experts, inter, hidden], ffn_up_exps the same, ffn_down_exps [experts, hidden, inter]
    HF    mlp.experts.gate_up_proj [experts, 2 * inter, hidden] ([gate | up] rows), mlp.experts.down_proj as the file's

or, with keep_quantized and the three in block types of BLOCK_LAYOUTS (every family above), as each
expert's weight in its blocks, mlp.experts.{j}.{gate_proj,up_proj,down_proj}.weight, decoded expert by expert from
the file's bytes (expert j's rows are the j-th run of the stacked tensor's blocks): no float copy of the experts.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvforge.loader.gguf_file import GGUFFile, GGUFTensor
from kvforge.loader.gguf_regroup import Dense, LayerTensors, Reader, Regrouped, Regrouping, require
from kvforge.quantization.gguf_blocks import BLOCK_LAYOUTS, decode_blocks
from kvforge.quantization.quantized_weight import QuantizedWeight

EXPERT_KINDS = frozenset({"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"})
_PROJECTIONS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                "ffn_down_exps.weight": "down_proj"}  # fmt: skip


def expert_readers(file: GGUFFile, layer: int, parts: dict[str, GGUFTensor], dense: Dense) -> dict[str, Reader]:
    """The layer's stacked experts as the checkpoint's mlp.experts.gate_up_proj and down_proj (none without)."""
    if "ffn_gate_exps.weight" not in parts:
        return {}
    gate, up, down = require(file, layer, parts, *_PROJECTIONS)
    prefix = f"model.layers.{layer}.mlp.experts"
    return {f"{prefix}.gate_up_proj": functools.partial(_gate_up, dense, gate, up),
            f"{prefix}.down_proj": functools.partial(dense, down)}  # fmt: skip


def _gate_up(dense: Dense, gate: GGUFTensor, up: GGUFTensor) -> torch.Tensor:
    """[experts, inter, hidden] twice -> [experts, 2 * inter, hidden]: gate's rows, then up's."""
    return torch.cat((dense(gate), dense(up)), dim=1)


def _kept_expert(file: GGUFFile, tensor: GGUFTensor, expert: int) -> QuantizedWeight:
    """Expert `expert`'s matrix [rows, K] of a stacked tensor [experts, rows, K], from its blocks."""
    try:
        return decode_blocks(file.read(tensor)[expert], tensor.tensor_type, tensor.shape[1:])
    except ValueError as e:
        raise ValueError(f"{file.path}: tensor {tensor.name}, expert {expert}: {e}") from e


def add_experts(regrouped: Regrouped, file: GGUFFile, layer: int, parts: dict[str, GGUFTensor], keep_quantized: bool,
                dense: Dense) -> None:  # fmt: skip
    """The layer's stacked experts (none without) into regrouped: kept in their blocks with keep_quantized where all
    three are of a type in BLOCK_LAYOUTS, else read as floats (counted in its dense_numel)."""
    stacked = require(file, layer, parts, *_PROJECTIONS) if "ffn_gate_exps.weight" in parts else []
    if not (keep_quantized and stacked and all(t.tensor_type in BLOCK_LAYOUTS for t in stacked)):
        regrouped.readers.update(expert_readers(file, layer, parts, dense))
        regrouped.dense_numel += sum(int(t.n_elements) for t in stacked)
        return
    for tensor, proj in zip(stacked, _PROJECTIONS.values()):
        layout = BLOCK_LAYOUTS[tensor.tensor_type]
        for expert in range(tensor.shape[0]):
            name = f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"
            regrouped.quantized[name] = functools.partial(_kept_expert, file, tensor, expert)
            regrouped.layouts[name] = layout
        # as loader/gguf.py counts the kept bytes: codes, and a half scale and offset per group
        group_bits = layout.bits * layout.group_size + 32
        regrouped.kept_bytes += int(tensor.n_elements) * group_bits // (8 * layout.group_size)


def _regroup(file: GGUFFile, layers: LayerTensors, config: dict[str, Any], keep_quantized: bool,
             dense: Dense) -> Regrouped:  # fmt: skip
    """Each layer's experts (add_experts)."""
    del config
    regrouped = Regrouped({})
    for layer, parts in sorted(layers.items()):
        add_experts(regrouped, file, layer, parts, keep_quantized, dense)
    return regrouped


STACKED_EXPERTS = Regrouping(EXPERT_KINDS, _regroup)
