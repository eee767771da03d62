"""A PEFT LoRA folder read into per-module (A, B) pairs, B scaled by the adapter's alpha / r (or alpha / sqrt(r)
with rsLoRA), each checked; the reader knows nothing of the model (pool.py places and shards the pairs).

    adapter_config.json        r, lora_alpha, use_rslora, target_modules, rank_pattern (ranks: read off the tensors)
    adapter_model.safetensors  base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight  [r, in_features]
                               base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight  [out_features, r]
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
                "layers_to_transform": "layers_to_transform", "target_parameters": "target_parameters"}
_SUFFIXES = {".lora_A.weight": 0, ".lora_B.weight": 1}


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


def read_adapter(request: LoRARequest, max_rank: int) -> LoRAAdapter:
    """The adapter's (A, scaled B) per module; ValueError naming the adapter for a missing file, a tensor that is not
    a LoRA A or B, an A without its B, mismatched ranks, or a rank above max_rank."""
    from safetensors.torch import load_file

    config = _read_config(request)
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
    alpha, rslora = config.get("lora_alpha", config.get("r", 8)), bool(config.get("use_rslora", False))
    weights = {}
    for name, (a, b) in pairs.items():
        if a is None or b is None:
            raise ValueError(f"LoRA adapter {request.name!r}: module {name!r} has lora_{'AB'[a is not None]} alone")
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
