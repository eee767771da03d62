"""From the HF architecture name in config.json to the model class that implements it."""

from __future__ import annotations

from torch import nn

from kvforge.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from kvforge.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from kvforge.models.mixtral import MixtralForCausalLM
from kvforge.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}


def resolve_model_class(hf_config: dict) -> type[nn.Module]:
    architectures = hf_config.get("architectures") or []
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"unsupported architecture {architectures!r}; supported: {sorted(MODEL_REGISTRY)}"
    )
