"""FLOPs and bytes of each op class in one batch, from the shapes: the modules' sizes and the batch's
token counts (plain ints from the SchedulerOutput, no device reads).

    GEMM y[M, N] = x[M, K] W^T     a linear layer's kernel says its FLOPs per row (2 N K) and the bytes of its
                                   weight as stored (layers/linear_kernel.py); + M (K + N) activation bytes
                                   (M: the batch's tokens; the LM head: the rows that sample, 2 M N K FLOPs)
    attention, per layer/sequence  4 heads head_dim FLOPs per (query, key) pair, as the planner's
                                   decode_attn_flops; a query chunk of q after c cached tokens has
                                   q c + q (q + 1) / 2 pairs (causal); bytes: its context's K and V once
                                   plus the queries and outputs
    cache write                    read this step's keys and values, write them into the cache
    norms, rotary, activation      elementwise: read and write every element once (approximate: the
                                   per-head q/k norms count one row per token)
    MoE experts                    2 M top_k 3 hidden inter FLOPs; the experts the batch's tokens pick
                                   (uniform routing, as the planner's experts_read) are read once
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kvforge.layers.linear import Linear
from kvforge.profiler.op_classes import ATTENTION, resolve
from kvforge.profiler.ranges import module_class


@dataclass(slots=True)
class Work:
    """What one op class does in a step: floating-point operations and bytes moved to and from memory."""

    flops: float = 0.0
    bytes: float = 0.0

    def add(self, flops: float, num_bytes: float) -> None:
        self.flops += flops
        self.bytes += num_bytes


@dataclass(frozen=True, slots=True)
class LinearShape:
    label: str  # op class
    out_features: int  # N
    in_features: int  # K
    weight_bytes: int  # as stored (quantized weights count their codes and scales)
    flops_per_row: int  # of one row of x


@dataclass(frozen=True, slots=True)
class AttentionShape:
    num_heads: int  # this rank's
    num_kv_heads: int
    head_dim: int
    cache_bytes_per_token: int  # this layer's K and V (and scales) per token


@dataclass(frozen=True, slots=True)
class MoEShape:
    num_experts: int
    top_k: int
    hidden: int
    inter: int  # this rank's intermediate size per expert
    weight_bytes: int


@dataclass(slots=True)
class Inventory:
    """The sizes of one rank's model that the arithmetic needs."""

    act_bytes: int
    hidden: int
    linears: list[LinearShape] = field(default_factory=list)
    lm_head: LinearShape | None = None
    attentions: list[AttentionShape] = field(default_factory=list)
    norm_widths: list[int] = field(default_factory=list)
    activation_widths: list[int] = field(default_factory=list)  # intermediate size of each gated MLP
    moes: list[MoEShape] = field(default_factory=list)
    has_embedding: bool = False


def _stored_bytes(module: nn.Module) -> int:
    """Bytes a module stores: its own tensors and its submodules'."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _layer_cache_bytes(kv_cache: tuple[torch.Tensor, ...]) -> int:
    """Bytes per token of one layer's paged cache tensors ([num_blocks, block_size, ...] each)."""
    return sum(t[0, 0].numel() * t.element_size() for t in kv_cache)


def build_inventory(model: nn.Module, kv_caches: list, dtype: torch.dtype) -> Inventory:
    """Walk one rank's model: linear layers by class, attention layers with their cache, norms, MoE."""
    inventory = Inventory(act_bytes=torch.tensor([], dtype=dtype).element_size(), hidden=model.config.hidden_size)
    cache_bytes = [_layer_cache_bytes(c) for c in kv_caches]
    for name, module in model.named_modules():
        label = module_class(name, module) if name else None
        kind = type(module).__name__
        if isinstance(module, Linear) and label is not None:
            kernel = module.kernel
            shape = LinearShape(label, module.out_features, module.in_features, kernel.weight_bytes(), kernel.flops(1))
            inventory.linears.append(shape)
            if name.endswith("gate_up_proj"):
                inventory.activation_widths.append(module.out_features // 2)
        elif label == ATTENTION and hasattr(module, "num_kv_heads"):
            layer = len(inventory.attentions)
            inventory.attentions.append(AttentionShape(module.num_heads, module.num_kv_heads, module.head_dim,
                                                       cache_bytes[layer] if layer < len(cache_bytes) else 0))
        elif label == "norm":
            inventory.norm_widths.append(module.weight.numel())
        elif label == "embedding" and name == "embed_tokens":
            inventory.has_embedding = True
        elif kind == "SparseMoeBlock":
            experts = module.experts
            inventory.moes.append(MoEShape(experts.num_local_experts, module.gate.cfg.top_k, inventory.hidden,
                                           experts.local_intermediate, _stored_bytes(experts)))
    head = getattr(model, "lm_head", None)
    if head is not None:
        inventory.lm_head = LinearShape("gemm.lm_head", head.num_local, head.hidden_size, _stored_bytes(head),
                                        2 * head.num_local * head.hidden_size)
    return inventory


def batch_kind(output) -> str:
    """"prefill", "decode", "mixed" (both in one batch) or "empty", from a SchedulerOutput."""
    prefill = [s.num_computed_tokens < s.num_prompt_tokens for s in output.scheduled]
    if not prefill:
        return "empty"
    return "prefill" if all(prefill) else "mixed" if any(prefill) else "decode"


def step_kind(kinds: list[str]) -> str:
    """The kind of a step of several batches (pipeline parallel): as one batch of all their requests."""
    found = {k for k in kinds if k != "empty"}
    return found.pop() if len(found) == 1 else "mixed" if found else "empty"


def _gemm(work: dict[str, Work], shape: LinearShape, rows: int, act: int) -> None:
    work.setdefault(shape.label, Work()).add(
        rows * shape.flops_per_row,
        shape.weight_bytes + rows * (shape.in_features + shape.out_features) * act)


def batch_work(inventory: Inventory, output) -> dict[str, Work]:
    """FLOPs and bytes per op class of one batch (a SchedulerOutput) on the rank of this inventory."""
    work: dict[str, Work] = {}
    scheduled = output.scheduled
    if not scheduled:
        return work
    act = inventory.act_bytes
    num_tokens = sum(len(s.token_ids) for s in scheduled)
    for shape in inventory.linears:
        _gemm(work, shape, num_tokens, act)
    if inventory.lm_head is not None:
        _gemm(work, inventory.lm_head, sum(1 for s in scheduled if s.needs_sample), act)
    chunks = [(len(s.token_ids), s.num_computed_tokens) for s in scheduled]
    attention = work.setdefault(resolve(ATTENTION, batch_kind(output)), Work())
    for layer in inventory.attentions:
        q_width = layer.num_heads * layer.head_dim
        for q, cached in chunks:
            pairs = q * cached + q * (q + 1) // 2
            attention.add(4 * q_width * pairs, (cached + q) * layer.cache_bytes_per_token + 2 * q * q_width * act)
        work.setdefault("cache_write", Work()).add(0, 2 * num_tokens * layer.cache_bytes_per_token)
        kv_width = layer.num_kv_heads * layer.head_dim
        work.setdefault("rotary", Work()).add(3 * num_tokens * (q_width + kv_width),
                                              2 * num_tokens * (q_width + kv_width) * act)
    for width in inventory.norm_widths:  # fused add + norm: x and residual in, both out
        work.setdefault("norm", Work()).add(4 * num_tokens * width, 4 * num_tokens * width * act)
    for width in inventory.activation_widths:  # silu(gate) * up: 2 in, 1 out
        work.setdefault("activation", Work()).add(5 * num_tokens * width, 3 * num_tokens * width * act)
    if inventory.has_embedding:
        work.setdefault("embedding", Work()).add(0, 2 * num_tokens * inventory.hidden * act)
    for moe in inventory.moes:
        experts_read = 1 - (1 - moe.top_k / moe.num_experts) ** num_tokens
        work.setdefault("moe.experts", Work()).add(
            2 * num_tokens * moe.top_k * 3 * moe.hidden * moe.inter,
            moe.weight_bytes * experts_read + 2 * num_tokens * moe.top_k * moe.hidden * act)
    return work


def add_work(total: dict[str, Work], more: dict[str, Work]) -> None:
    for label, item in more.items():
        total.setdefault(label, Work()).add(item.flops, item.bytes)
