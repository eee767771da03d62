"""Mixture-of-experts layers: the routed experts (one fused op over all of them) and the sparse MLP block
that puts router, experts and shared experts together.

Parallel hook: with tp_size > 1 each rank holds a share of the experts' weights and returns its partial
sum of the layer output (the caller all-reduces). Either every expert's intermediate dim is sliced
(tensor parallel: rank r keeps rows [r * I / n, (r + 1) * I / n) of gate and up, the same columns of
down), or whole experts are dealt out (expert parallel: rank r keeps experts [r * E / n, (r + 1) * E / n)
and drops the pairs routed elsewhere). The slicing happens at load time, so model files never see it.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from kvforge.distributed.communicator import tp_all_reduce
from kvforge.distributed.parallel_state import get_parallel_state
from kvforge.kernels.ops import current_ops
from kvforge.layers.linear_kernel import WeightArena
from kvforge.layers.moe_router import Router

_PROJ_SHARD = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1}  # Mixtral names gate, up, down w1, w3, w2
_EXPERT_TENSOR = re.compile(r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight")
_STACKED_TENSOR = re.compile(r"(.+\.experts)\.(gate_up_proj|down_proj)")  # transformers >= 5 layout


class FusedMoE(nn.Module):
    """The routed experts of one layer, stacked: gate_up_proj [local experts, 2 * local inter, hidden]
    ([gate | up] rows) and down_proj [local experts, hidden, local inter]."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int,
        tp_rank: int = 0, tp_size: int = 1, expert_parallel: bool = False, dtype: torch.dtype = torch.float32,
    ) -> None:  # fmt: skip
        super().__init__()
        self.ops = current_ops()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, tp_size={tp_size}), got {tp_rank}")
        split, name = (num_experts, "num_experts") if expert_parallel else (intermediate_size, "intermediate")
        if split % tp_size:
            raise ValueError(f"{name} ({split}) must be divisible by tp_size ({tp_size})")
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.num_local_experts = num_experts // tp_size if expert_parallel else num_experts
        self.local_intermediate = intermediate_size if expert_parallel else intermediate_size // tp_size
        self.first_expert = tp_rank * self.num_local_experts if expert_parallel else 0
        self.inter_start = 0 if expert_parallel else tp_rank * self.local_intermediate
        self.expert_parallel = expert_parallel and tp_size > 1
        num_local, inter = self.num_local_experts, self.local_intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_local, 2 * inter, hidden_size, dtype=dtype),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_local, hidden_size, inter, dtype=dtype), requires_grad=False)
        self.lora: nn.Module | None = None  # LoRA adapters' slots of these experts (lora/experts.py)
        # The experts kept in a quantized layout, in place of gate_up_proj and down_proj (called as
        # kept(x, topk_weights, topk_ids); quantization/kept_experts.py), and where it packs them (set by the loader)
        self.kept: nn.Module | None = None
        self.weight_arena: WeightArena | None = None

    def load_expert(self, expert: int, proj: str, tensor: torch.Tensor) -> None:
        """One expert's checkpoint matrix: proj is gate_proj/w1 [inter, hidden], up_proj/w3 [inter, hidden]
        or down_proj/w2 [hidden, inter]. Experts and slices of other ranks are skipped."""
        local = expert - self.first_expert
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint has expert {expert}, but the layer has {self.num_experts}")
        if not 0 <= local < self.num_local_experts:
            return
        inter = slice(self.inter_start, self.inter_start + self.local_intermediate)
        if proj in _PROJ_SHARD:
            first_row = _PROJ_SHARD[proj] * self.local_intermediate
            rows = slice(first_row, first_row + self.local_intermediate)
            _copy_checked(self.gate_up_proj.data[local, rows], tensor[inter], proj)
        else:
            _copy_checked(self.down_proj.data[local], tensor[:, inter], proj)

    def load_stacked(self, param_name: str, tensor: torch.Tensor) -> None:
        """transformers' stacked layout: gate_up_proj [experts, 2 * inter, hidden] or down_proj
        [experts, hidden, inter]."""
        if param_name == "down_proj":
            for expert in range(tensor.shape[0]):
                self.load_expert(expert, "down_proj", tensor[expert])
            return
        gate, up = tensor.chunk(2, dim=1)
        for expert in range(tensor.shape[0]):
            self.load_expert(expert, "gate_proj", gate[expert])
            self.load_expert(expert, "up_proj", up[expert])

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, hidden]; topk_ids: global expert ids. Returns this rank's [num_tokens, hidden]."""
        if self.expert_parallel:
            local = topk_ids - self.first_expert
            topk_ids = torch.where((local >= 0) & (local < self.num_local_experts), local, -1)
        if self.kept is not None:
            return self.kept(x, topk_weights, topk_ids)
        lora = None if self.lora is None else self.lora.tensors(x.shape[0])
        return self.ops.fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, lora)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, proj: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"expert {proj} slice has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


def load_expert_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> str | None:
    """Load a checkpoint tensor of routed experts (per expert, `...experts.3.gate_proj.weight` or Mixtral's
    `...experts.3.w1.weight`, or stacked, `...experts.gate_up_proj`) into its FusedMoE.

    Returns the name of the parameter it filled, or None when name is not an expert tensor."""
    if match := _EXPERT_TENSOR.fullmatch(name):
        module_name, expert, proj = match.groups()
        model.get_submodule(module_name).load_expert(int(expert), proj, tensor)
        param = "down_proj" if proj in ("down_proj", "w2") else "gate_up_proj"
        return f"{module_name}.{param}"
    if match := _STACKED_TENSOR.fullmatch(name):
        module_name, param = match.groups()
        model.get_submodule(module_name).load_stacked(param, tensor)
        return f"{module_name}.{param}"
    return None


class SparseMoeBlock(nn.Module):
    """out = experts(x, router(x)) + [sigmoid(shared_expert_gate(x)) *] shared_experts(x).

    shared_experts: an MLP every token goes through (DeepSeek, Qwen2-MoE), None without (Mixtral);
    shared_expert_gate: Qwen2-MoE's per-token scalar gate [1, hidden] on it."""

    def __init__(
        self, gate: Router, experts: FusedMoE, shared_experts: nn.Module | None = None,
        shared_expert_gate: nn.Module | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.shared_experts = shared_experts
        self.shared_expert_gate = shared_expert_gate
        self.parallel = get_parallel_state()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)
        out = tp_all_reduce(self.parallel, self.experts(x, topk_weights, topk_ids))  # each rank's share
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out
