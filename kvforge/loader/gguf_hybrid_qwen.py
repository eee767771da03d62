"""The hybrid Qwen family's Gated DeltaNet tensors and experts in a GGUF file (Qwen3-Next, Qwen3.5 dense and MoE),
given back as its Hugging Face checkpoint's tensors.

llama.cpp's converter ungroups Qwen3-Next's linear-attention in-projection, tiles Qwen3.5's value heads, and stores
the decay as it is applied (K key heads, r = value heads per key head):

    Qwen3-Next  HF    linear_attn.in_proj_qkvz   rows per key head h: [q_h (dk) | k_h (dk) | v_h (r dv) | z_h (r dv)]
                GGUF  attn_qkv                   rows [q_0 .. q_K-1 | k_0 .. k_K-1 | v_0 .. v_K-1]
                      attn_gate                  rows [z_0 .. z_K-1]
    Qwen3.5     HF    value heads grouped by key head: [g0 v0, g0 v1, .., g1 v0, ..] (g: key head, v: its r heads)
                GGUF  value heads tiled:              [g0 v0, g1 v0, .., g0 v1, ..]
                      in the v rows of attn_qkv (in_proj_qkv), the rows of attn_gate (in_proj_z), ssm_beta
                      (in_proj_b), ssm_alpha (in_proj_a), ssm_a and ssm_dt, the v channels of ssm_conv1d and the
                      columns of ssm_out (out_proj)
    both        HF    linear_attn.A_log          GGUF ssm_a = -exp(A_log)
                HF    mlp.experts.{j}.*_proj     GGUF ffn_{gate,up,down}_exps, the experts stacked
                                                 (gguf_stacked_experts.py: kept in their quantized blocks as the
                                                 other MoE families' are)

Every other tensor keeps its HF layout under another name (gguf_architectures.py). The Gated DeltaNet tensors
regrouped here are read as floats.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvforge.loader.gguf_file import GGUFFile, GGUFTensor
from kvforge.loader.gguf_regroup import Dense, LayerTensors, Reader, Regrouped, Regrouping, require
from kvforge.loader.gguf_stacked_experts import EXPERT_KINDS, add_experts


def _regroup_qwen3_next(file: GGUFFile, layers: LayerTensors, config: dict[str, Any], keep_quantized: bool,
             dense: Dense) -> Regrouped:  # fmt: skip
    readers: dict[str, Reader] = {}
    regrouped = Regrouped(readers)
    for layer, parts in sorted(layers.items()):
        prefix = f"model.layers.{layer}"
        if "attn_qkv.weight" in parts:
            qkv, z, a = require(file, layer, parts, "attn_qkv.weight", "attn_gate.weight", "ssm_a")
            readers[f"{prefix}.linear_attn.in_proj_qkvz.weight"] = functools.partial(
                _qkvz, dense, qkv, z, config["linear_num_key_heads"]
            )
            readers[f"{prefix}.linear_attn.A_log"] = functools.partial(_a_log, dense, a)
        add_experts(regrouped, file, layer, parts, keep_quantized, dense)
    regrouped.dense_numel += _linear_attention_numel(layers)
    return regrouped


def _regroup_qwen3_5(file: GGUFFile, layers: LayerTensors, config: dict[str, Any], keep_quantized: bool,
                     dense: Dense) -> Regrouped:  # fmt: skip
    num_key_heads = config["linear_num_key_heads"]
    per_key = config["linear_num_value_heads"] // num_key_heads
    key_rows, value_head = 2 * num_key_heads * config["linear_key_head_dim"], config["linear_value_head_dim"]
    readers: dict[str, Reader] = {}
    regrouped = Regrouped(readers)
    for layer, parts in sorted(layers.items()):
        prefix = f"model.layers.{layer}.linear_attn"
        grouped = functools.partial(_grouped, dense, num_key_heads, per_key)
        if "attn_qkv.weight" in parts:
            qkv, z, b, a, a_log, dt, conv, out = require(
                file, layer, parts, "attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight",
                "ssm_a", "ssm_dt.bias", "ssm_conv1d.weight", "ssm_out.weight")  # fmt: skip
            readers[f"{prefix}.in_proj_qkv.weight"] = functools.partial(grouped, qkv, value_head, 0, key_rows)
            readers[f"{prefix}.in_proj_z.weight"] = functools.partial(grouped, z, value_head, 0, 0)
            readers[f"{prefix}.in_proj_b.weight"] = functools.partial(grouped, b, 1, 0, 0)
            readers[f"{prefix}.in_proj_a.weight"] = functools.partial(grouped, a, 1, 0, 0)
            readers[f"{prefix}.A_log"] = functools.partial(_grouped, functools.partial(_a_log, dense), num_key_heads,
                                                           per_key, a_log, 1, 0, 0)  # fmt: skip
            readers[f"{prefix}.dt_bias"] = functools.partial(grouped, dt, 1, 0, 0)
            readers[f"{prefix}.conv1d.weight"] = functools.partial(grouped, conv, value_head, 0, key_rows)
            readers[f"{prefix}.out_proj.weight"] = functools.partial(grouped, out, value_head, 1, 0)
        add_experts(regrouped, file, layer, parts, keep_quantized, dense)
    regrouped.dense_numel += _linear_attention_numel(layers)
    return regrouped


def _linear_attention_numel(layers: LayerTensors) -> int:
    """Weights of the layers' tensors other than the experts (add_experts counts theirs)."""
    return sum(int(t.n_elements) for parts in layers.values() for name, t in parts.items()
               if name.split(".")[0] not in EXPERT_KINDS)  # fmt: skip


def _grouped(dense: Dense, num_key_heads: int, per_key: int, tensor: GGUFTensor, head_size: int, dim: int,
             skip: int) -> torch.Tensor:  # fmt: skip
    """The tensor with its value heads (of head_size along dim, after the first skip entries) back in grouped order
    (the module docstring's picture): [per_key, key heads, head_size] -> [key heads, per_key, head_size]."""
    values = dense(tensor)
    kept, tiled = values.split([skip, values.shape[dim] - skip], dim=dim)
    shape = list(tiled.shape)
    tiled = tiled.reshape(*shape[:dim], per_key, num_key_heads, head_size, *shape[dim + 1 :])
    return torch.cat([kept, tiled.transpose(dim, dim + 1).reshape(shape)], dim=dim)


def _qkvz(dense: Dense, qkv: GGUFTensor, gate: GGUFTensor, num_key_heads: int) -> torch.Tensor:
    """attn_qkv and attn_gate -> in_proj_qkvz (the module docstring's picture)."""
    qkv_rows, z = dense(qkv), dense(gate)  # [2 * K * dk + K * r * dv, hidden], [K * r * dv, hidden]
    key_rows = (qkv_rows.shape[0] - z.shape[0]) // 2  # K * dk
    q, k, v = qkv_rows.split([key_rows, key_rows, z.shape[0]])
    hidden = z.shape[-1]
    return torch.cat([t.reshape(num_key_heads, -1, hidden) for t in (q, k, v, z)], dim=1).reshape(-1, hidden)


def _a_log(dense: Dense, a: GGUFTensor) -> torch.Tensor:
    """A_log from ssm_a = -exp(A_log)."""
    return torch.log(-dense(a).float())


QWEN3_NEXT_REGROUPING = Regrouping(frozenset({"attn_qkv", "attn_gate", "ssm_a"}) | EXPERT_KINDS, _regroup_qwen3_next)
QWEN3_5_REGROUPING = Regrouping(
    frozenset({"attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_a", "ssm_dt", "ssm_conv1d", "ssm_out"})
    | EXPERT_KINDS,
    _regroup_qwen3_5,
)
