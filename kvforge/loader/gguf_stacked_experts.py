"""Routed experts stacked one tensor a projection in a GGUF file (Mixtral, Qwen2-MoE, Qwen3-MoE, Qwen3-Next, Qwen3.5
MoE), given back as the stacked tensors of the Hugging Face checkpoints (transformers >= 5):

    GGUF  blk.{i}.ffn_gate_exps [experts, inter, hidden], ffn_up_exps the same, ffn_down_exps [experts, hidden, inter]
    HF    mlp.experts.gate_up_proj [experts, 2 * inter, hidden] ([gate | up] rows), mlp.experts.down_proj as the file's

Read as floats (the model's routed experts run float weights).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvforge.loader.gguf_file import GGUFFile, GGUFTensor
from kvforge.loader.gguf_regroup import Dense, LayerTensors, Reader, Regrouped, Regrouping, require

EXPERT_KINDS = frozenset({"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"})


def expert_readers(file: GGUFFile, layer: int, parts: dict[str, GGUFTensor], dense: Dense) -> dict[str, Reader]:
    """The layer's stacked experts as the checkpoint's mlp.experts.gate_up_proj and down_proj (none without)."""
    if "ffn_gate_exps.weight" not in parts:
        return {}
    gate, up, down = require(file, layer, parts, "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
    prefix = f"model.layers.{layer}.mlp.experts"
    return {f"{prefix}.gate_up_proj": functools.partial(_gate_up, dense, gate, up),
            f"{prefix}.down_proj": functools.partial(dense, down)}  # fmt: skip


def _gate_up(dense: Dense, gate: GGUFTensor, up: GGUFTensor) -> torch.Tensor:
    """[experts, inter, hidden] twice -> [experts, 2 * inter, hidden]: gate's rows, then up's."""
    return torch.cat((dense(gate), dense(up)), dim=1)


def _regroup(file: GGUFFile, layers: LayerTensors, config: dict[str, Any], keep_quantized: bool,
             dense: Dense) -> Regrouped:  # fmt: skip
    del config, keep_quantized  # read as floats
    readers: dict[str, Reader] = {}
    for layer, parts in sorted(layers.items()):
        readers.update(expert_readers(file, layer, parts, dense))
    return Regrouped(readers, dense_numel=sum(int(t.n_elements) for parts in layers.values() for t in parts.values()))


STACKED_EXPERTS = Regrouping(EXPERT_KINDS, _regroup)
