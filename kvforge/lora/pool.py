"""The device slots of one engine's LoRA adapters and the host-side registry they are swapped in from.

    host registry   up to max_cpu_loras adapters read, checked and cut to this rank's share (LRU)
    device slots    max_loras per LoRA layer (layer.py) and per MoE layer's routed experts (experts.py); a step's
                    adapters are put in slots before it runs,
                    evicting the least recently used adapter that the step does not use
    token_slots     [max_tokens] slot id of each row of the step (-1: no adapter), read by every LoRA layer

The scheduler never runs more than max_loras adapters in one step (engine/scheduler.py), so a step's adapters
always find slots.
"""

from __future__ import annotations

import re
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from kvforge.config import LoRAConfig
from kvforge.kernels.ops import OpTable
from kvforge.layers.linear import Linear
from kvforge.layers.moe import FusedMoE
from kvforge.lora.adapter import read_adapter
from kvforge.lora.experts import PIECES, ExpertLoRASlots
from kvforge.lora.layer import LoRASlots
from kvforge.lora.request import LoRARequest

# the checkpoint modules an adapter may target: attention and MLP projections (merged ones are placed by the
# model's merged_params: q/k/v -> qkv_proj, gate/up -> gate_up_proj)
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")
_EXPERT_MODULE = re.compile(rf"(.+\.experts)\.(\d+)\.({'|'.join(PIECES)})")
# one adapter on this rank: LoRA layer name -> checkpoint matrix index (routed experts: (expert, matrix name)) ->
# (A, B), local shares in the dtype of their slots
LocalAdapter = dict[str, dict[int | tuple[int, str], tuple[torch.Tensor, torch.Tensor]]]


def _placed_names(model: nn.Module) -> dict[str, tuple[str, int]]:
    """Checkpoint-module fragment -> (the model's layer fragment, matrix index), for the targets."""
    merged = getattr(model, "merged_params", {})
    return {f".{t}.": merged.get(f".{t}.", (f".{t}.", 0)) for t in TARGET_MODULES}


def slot_dtype(lora_dtype: str, model_dtype: torch.dtype, ops: OpTable) -> torch.dtype:
    """The dtype of the adapters' slots (LoRAConfig.lora_dtype): as named, or for "auto" bfloat16 where the CPU's
    fused op runs a float32 model's LoRA layers (it widens 16-bit weights in registers and sums in float32, and a
    decode step's time there is the adapters' bytes), else the model dtype."""
    if lora_dtype != "auto":
        return getattr(torch, lora_dtype)
    return torch.bfloat16 if ops.lora_fused is not None and model_dtype == torch.float32 else model_dtype


class LoRAPool:
    """Attaches LoRA slots to the model's target layers; `load` reads and checks an adapter (ValueError naming it),
    `prepare_step` puts the step's adapters in slots and writes the per-row slot ids."""

    def __init__(self, model: nn.Module, config: LoRAConfig, max_tokens: int, dtype: torch.dtype,
                 device: torch.device, ops: OpTable) -> None:
        """dtype: the model's, which the routed experts' slots keep (their grouped matmuls multiply them with the
        activations as they are); the linear layers' slots take config.lora_dtype (slot_dtype)."""
        self.config = config
        self.model = model
        self.dtype = slot_dtype(config.lora_dtype, dtype, ops)  # the linear layers' slots
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self._places = _placed_names(model)
        fused = {merged.strip(".") for merged, _ in self._places.values()}
        self.layers: dict[str, LoRASlots | ExpertLoRASlots] = {}
        self.num_experts = 0  # routed experts per MoE layer (0: none)
        for name, module in model.named_modules():
            if isinstance(module, Linear) and name.rsplit(".", 1)[-1] in fused:
                module.lora = LoRASlots(module, config.max_loras, config.max_lora_rank, self.token_slots, ops,
                                        self.dtype)
                self.layers[name] = module.lora
            elif isinstance(module, FusedMoE):
                if module.kept is not None:
                    raise ValueError(f"LoRA adapters need float experts, but {name} keeps its experts quantized (a "
                                     "GGUF file's blocks): load it with quantization='none'")
                module.lora = ExpertLoRASlots(module, config.max_loras, config.max_lora_rank, self.token_slots, dtype)
                self.layers[name] = module.lora
                self.num_experts = module.num_experts
        self.host: OrderedDict[int, LocalAdapter] = OrderedDict()  # int_id -> this rank's share, LRU first
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # int_id -> device slot, LRU first
        self.paths: dict[int, str] = {}

    def _place(self, request: LoRARequest, module: str) -> tuple[str, int | tuple[int, str]] | None:
        """The LoRA layer and matrix index of a checkpoint module; None for a layer of another pipeline stage."""
        for old, new in getattr(self.model, "checkpoint_renames", {}).items():
            module = module.replace(old, new)
        name, index = module, None
        if (expert := _EXPERT_MODULE.fullmatch(module)) is not None:
            name, index = expert.group(1), (int(expert.group(2)), expert.group(3))
        else:
            for fragment, (merged, shard) in self._places.items():
                if f".{module}.".endswith(fragment):
                    name, index = f".{module}.".removesuffix(fragment).removeprefix(".") + merged.rstrip("."), shard
                    break
        layer = self.layers.get(name)
        if index is not None and isinstance(layer, ExpertLoRASlots if expert is not None else LoRASlots):
            if expert is not None and index[0] >= layer.num_experts:
                raise ValueError(f"LoRA adapter {request.name!r}: module {module!r} names expert {index[0]}, but "
                                 f"the layer has {layer.num_experts}")
            return name, index
        layer_index = _LAYER_INDEX.match(name)
        if index is not None and layer_index is not None and not (
                self.model.start_layer <= int(layer_index.group(1)) < self.model.end_layer):
            return None  # a layer of another pipeline stage
        raise ValueError(f"LoRA adapter {request.name!r} targets module {module!r}, which has no LoRA layer in "
                         f"{type(self.model).__name__} (targets: {', '.join(TARGET_MODULES)}, and the routed "
                         f"experts' {', '.join(PIECES)})")

    def load(self, request: LoRARequest) -> LocalAdapter:
        """The adapter's share on this rank, read on first use (and again once the host registry dropped it)."""
        known = self.paths.get(request.int_id, request.path)
        if known != request.path:
            raise ValueError(f"LoRA adapter {request.name!r}: int_id {request.int_id} already names {known!r}")
        if request.int_id in self.host:
            self.host.move_to_end(request.int_id)
            return self.host[request.int_id]
        adapter = read_adapter(request, self.config.max_lora_rank, self.num_experts)
        local: LocalAdapter = {}
        for module, (a, b) in adapter.weights.items():
            placed = self._place(request, module)
            if placed is None:
                continue
            name, shard = placed
            layer = self.layers[name]
            out_features, in_features = layer.full_shape(shard)
            if a.shape[1] != in_features or b.shape[0] != out_features:
                raise ValueError(f"LoRA adapter {request.name!r}: module {module!r} has A {tuple(a.shape)} and B "
                                 f"{tuple(b.shape)}, but the base layer is [{out_features}, {in_features}]")
            shares = layer.local(shard, a, b)
            if shares is None:
                continue  # another rank's expert
            a, b = shares
            dtype = layer.a.dtype if isinstance(layer, LoRASlots) else layer.a13.dtype
            local.setdefault(name, {})[shard] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
        self.paths[request.int_id] = request.path
        self.host[request.int_id] = local
        while len(self.host) > self.config.num_cpu_loras:
            self.host.popitem(last=False)
        return local

    def _slot_for(self, request: LoRARequest, in_step: set[int]) -> int:
        if request.int_id in self.slot_of:
            self.slot_of.move_to_end(request.int_id)
            return self.slot_of[request.int_id]
        used = set(self.slot_of.values())
        free = [s for s in range(self.config.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(i for i in self.slot_of if i not in in_step)
            slot = self.slot_of.pop(victim)
        local = self.load(request)
        for name, layer in self.layers.items():
            layer.write(slot, local.get(name, {}))
        self.slot_of[request.int_id] = slot
        return slot

    def prepare_step(self, loras: list[LoRARequest | None], num_tokens_each: np.ndarray) -> None:
        """Slots for the adapters of a step's requests (one entry per request, None: the base model), and the slot
        of each of its rows (num_tokens_each: rows per request) in token_slots; the rest of the buffer -1."""
        in_step = {lora.int_id for lora in loras if lora is not None}
        assert len(in_step) <= self.config.max_loras, "a step with more adapters than slots"
        slots = np.array([-1 if lora is None else self._slot_for(lora, in_step) for lora in loras], dtype=np.int64)
        per_row = np.repeat(slots, num_tokens_each)
        self.token_slots[: len(per_row)].copy_(torch.from_numpy(per_row), non_blocking=True)
        self.token_slots[len(per_row) :].fill_(-1)
