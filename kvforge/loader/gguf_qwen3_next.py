"""Qwen3-Next's Gated DeltaNet projections, decay and experts in a GGUF file, given back as its Hugging Face
checkpoint's tensors.

llama.cpp's converter ungroups the linear attention's in-projection and stores the decay as it is applied:

    HF    linear_attn.in_proj_qkvz   rows per key head h: [q_h (dk) | k_h (dk) | v_h (r * dv) | z_h (r * dv)]
    GGUF  attn_qkv                   rows [q_0 .. q_K-1 | k_0 .. k_K-1 | v_0 .. v_K-1]   (r = value heads per key head)
          attn_gate                  rows [z_0 .. z_K-1]
    HF    linear_attn.A_log          GGUF ssm_a = -exp(A_log)
    HF    mlp.experts.{j}.*_proj     GGUF ffn_{gate,up,down}_exps, the experts stacked: read as the stacked checkpoint
                                     tensors mlp.experts.gate_up_proj ([gate | up] rows) and mlp.experts.down_proj

Every other tensor keeps its HF layout under another name (gguf_architectures.py). The experts are read as floats
(the model's routed experts run float weights).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvforge.loader.gguf_file import GGUFFile, GGUFTensor
from kvforge.loader.gguf_regroup import Dense, LayerTensors, Reader, Regrouped, Regrouping, require


def _regroup(file: GGUFFile, layers: LayerTensors, config: dict[str, Any], keep_quantized: bool,
             dense: Dense) -> Regrouped:  # fmt: skip
    del keep_quantized  # every tensor regrouped here is read as a float one
    readers: dict[str, Reader] = {}
    for layer, parts in sorted(layers.items()):
        prefix = f"model.layers.{layer}"
        if "attn_qkv.weight" in parts:
            qkv, z, a = require(file, layer, parts, "attn_qkv.weight", "attn_gate.weight", "ssm_a")
            readers[f"{prefix}.linear_attn.in_proj_qkvz.weight"] = functools.partial(
                _qkvz, dense, qkv, z, config["linear_num_key_heads"])
            readers[f"{prefix}.linear_attn.A_log"] = functools.partial(_a_log, dense, a)
        if "ffn_gate_exps.weight" in parts:
            gate, up, down = require(file, layer, parts, "ffn_gate_exps.weight", "ffn_up_exps.weight",
                                     "ffn_down_exps.weight")  # fmt: skip
            readers[f"{prefix}.mlp.experts.gate_up_proj"] = functools.partial(_gate_up, dense, gate, up)
            readers[f"{prefix}.mlp.experts.down_proj"] = functools.partial(dense, down)
    numel = sum(int(t.n_elements) for parts in layers.values() for t in parts.values())
    return Regrouped(readers, dense_numel=numel)


def _qkvz(dense: Dense, qkv: GGUFTensor, gate: GGUFTensor, num_key_heads: int) -> torch.Tensor:
    """attn_qkv and attn_gate -> in_proj_qkvz (the module docstring's picture)."""
    qkv_rows, z = dense(qkv), dense(gate)  # [2 * K * dk + K * r * dv, hidden], [K * r * dv, hidden]
    key_rows = (qkv_rows.shape[0] - z.shape[0]) // 2  # K * dk
    q, k, v = qkv_rows.split([key_rows, key_rows, z.shape[0]])
    hidden = z.shape[-1]
    return torch.cat([t.reshape(num_key_heads, -1, hidden) for t in (q, k, v, z)], dim=1).reshape(-1, hidden)


def _a_log(dense: Dense, a: GGUFTensor) -> torch.Tensor:
    return torch.log(-dense(a).float())


def _gate_up(dense: Dense, gate: GGUFTensor, up: GGUFTensor) -> torch.Tensor:
    """[experts, inter, hidden] twice -> [experts, 2 * inter, hidden]: gate's rows, then up's."""
    return torch.cat((dense(gate), dense(up)), dim=1)


QWEN3_NEXT_REGROUPING = Regrouping(
    frozenset({"attn_qkv", "attn_gate", "ssm_a", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}), _regroup
)
