"""A PEFT LoRA folder read into per-module (A, B) pairs, B scaled by the adapter's alpha / r (or alpha / sqrt(r)
with rsLoRA), each checked; the reader knows nothing of the model but its number of routed experts (pool.py places
and shards the pairs).

    adapter_config.json        r, lora_alpha, use_rslora, target_modules, target_parameters, rank_pattern (ranks: read
                               off the tensors)
    adapter_model.safetensors  base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight  [r, in_features]
                               base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight  [out_features, r]

Routed experts come per expert module (layers.3.mlp.experts.5.gate_proj, as above), or, with target_parameters, as
one pair per stacked parameter of transformers' experts (gate_up_proj [E, 2 * inter, hidden], down_proj [E, hidden,
inter]), every expert's rank-r factors in one matrix:

    layers.3.mlp.experts[.base_layer].lora_A.weight  [E * r, in]    rows e * r ... e * r + r: expert e's A
    layers.3.mlp.experts[.base_layer].lora_B.weight  [out, r * E]   column j * E + e: column j of expert e's B

PEFT wraps the experts module once per targeted parameter, in the module's parameter order (gate_up_proj, then
down_proj), so the last targeted is the outer wrapper (no "base_layer." infix) and each earlier one sits one
"base_layer." deeper. They are read as per-expert pairs named layers.3.mlp.experts.5.gate_up_proj / .down_proj.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from kvforge.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# what a LoRA of a float base means here; an adapter asking for more is refused by name
_UNSUPPORTED = {"use_dora": "DoRA", "alpha_pattern": "alpha_pattern", "modules_to_save": "modules_to_save",
                "layers_to_transform": "layers_to_transform"}
_SUFFIXES = {".lora_A.weight": 0, ".lora_B.weight": 1}
# NOTE: the stacked parameters of transformers' experts modules, in their order (PEFT nests its wrappers by it)
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
_WRAPPED = ".base_layer"


@dataclass(slots=True)
class LoRAAdapter:
    """weights: module name as the base checkpoint spells it, without "model." (e.g. "layers.0.self_attn.q_proj")
    -> (A [r, in_features], B [out_features, r] times the scaling), float32 on the host."""

    request: LoRARequest
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def rank(self) -> int:
        return max(a.shape[0] for a, _ in self.weights.values())


def _read_config(request: LoRARequest) -> dict:
    folder = Path(request.path)
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"LoRA adapter {request.name!r}: {str(folder)!r} has no {CONFIG_FILE}")
    config = json.loads(config_path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {request.name!r}: peft_type {config['peft_type']!r} is not LORA")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {request.name!r}: {what} ({key}={config[key]!r}) is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {request.name!r}: bias={config['bias']!r} is not supported (only 'none')")
    return config


def _module_name(key: str) -> tuple[str, int] | None:
    """'base_model.model.model.layers.0.mlp.up_proj.lora_B.weight' -> ('layers.0.mlp.up_proj', 1); None: not A/B."""
    for suffix, which in _SUFFIXES.items():
        if key.endswith(suffix):
            return key.removesuffix(suffix).removeprefix("base_model.model.").removeprefix("model."), which
    return None


def _check_target_parameters(request: LoRARequest, config: dict) -> list[str]:
    targets = list(config.get("target_parameters") or [])
    for target in targets:
        if target.rsplit(".", 1)[-1] not in EXPERT_PARAMS or ".experts." not in f".{target}":
            raise ValueError(f"LoRA adapter {request.name!r}: target_parameters entry {target!r} is not supported "
                             f"(only the experts' {' and '.join(EXPERT_PARAMS)})")
    return targets


def _stacked_param(request: LoRARequest, module: str, targets: list[str]) -> tuple[str, str] | None:
    """('layers.0.mlp.experts', 'down_proj') for a module of PEFT's wrappers of a stacked experts parameter, None for
    a plain module."""
    depth, experts = 0, module
    while experts.endswith(_WRAPPED):
        experts, depth = experts.removesuffix(_WRAPPED), depth + 1
    targeted = [param for param in EXPERT_PARAMS
                if any(f".{experts}.{param}".endswith(f".{target}") for target in targets)]
    if not targeted:
        return None
    if depth >= len(targeted):
        raise ValueError(f"LoRA adapter {request.name!r}: module {module!r} wraps more parameters than "
                         f"target_parameters names ({targeted})")
    return experts, targeted[len(targeted) - 1 - depth]


def _per_expert(request: LoRARequest, module: str, stacked: tuple[str, str], a: torch.Tensor, b: torch.Tensor,
                num_experts: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A stacked pair (A [E * r, in], B [out, r * E]) of (experts module, parameter) as one (A [r, in], B [out, r])
    per expert."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or num_experts < 1 or a.shape[0] % num_experts:
        raise ValueError(f"LoRA adapter {request.name!r}: module {module!r} has A {tuple(a.shape)} and B "
                         f"{tuple(b.shape)}, not [E * r, in] and [out, r * E] for the model's {num_experts} experts")
    rank = a.shape[0] // num_experts
    a_each, b_each = a.view(num_experts, rank, -1), b.view(b.shape[0], rank, num_experts)
    experts, param = stacked
    return {f"{experts}.{e}.{param}": (a_each[e], b_each[:, :, e]) for e in range(num_experts)}


def read_adapter(request: LoRARequest, max_rank: int, num_experts: int = 0) -> LoRAAdapter:
    """The adapter's (A, scaled B) per module; ValueError naming the adapter for a missing file, a tensor that is not
    a LoRA A or B, an A without its B, mismatched ranks, or a rank above max_rank. num_experts: the model's routed
    experts per MoE layer (0: none), which splits the stacked pairs of target_parameters per expert."""
    from safetensors.torch import load_file

    config = _read_config(request)
    targets = _check_target_parameters(request, config)
    weights_path = Path(request.path) / WEIGHTS_FILE
    if not weights_path.is_file():
        raise ValueError(f"LoRA adapter {request.name!r}: {str(request.path)!r} has no {WEIGHTS_FILE}")
    pairs: dict[str, list[torch.Tensor | None]] = {}
    for key, tensor in load_file(str(weights_path)).items():
        placed = _module_name(key)
        if placed is None:
            raise ValueError(f"LoRA adapter {request.name!r}: tensor {key!r} is not a LoRA A or B weight")
        pairs.setdefault(placed[0], [None, None])[placed[1]] = tensor.float()
    if not pairs:
        raise ValueError(f"LoRA adapter {request.name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, (a, b) in pairs.items():
        if a is None or b is None:
            raise ValueError(f"LoRA adapter {request.name!r}: module {name!r} has lora_{'AB'[a is not None]} alone")
        stacked = _stacked_param(request, name, targets) if targets else None
        if stacked is None:
            modules[name] = (a, b)
        else:
            modules.update(_per_expert(request, name, stacked, a, b, num_experts))
    alpha, rslora = config.get("lora_alpha", config.get("r", 8)), bool(config.get("use_rslora", False))
    weights = {}
    for name, (a, b) in modules.items():
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
            raise ValueError(f"LoRA adapter {request.name!r}: module {name!r} has A {tuple(a.shape)} and B "
                             f"{tuple(b.shape)}, not [r, in] and [out, r]")
        if rank > max_rank:
            raise ValueError(f"LoRA adapter {request.name!r}: module {name!r} has rank {rank}, above "
                             f"max_lora_rank={max_rank}")
        scaling = alpha / (math.sqrt(rank) if rslora else rank)
        weights[name] = (a, b * scaling)
    return LoRAAdapter(request, weights)
