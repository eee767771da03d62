"""From the HF architecture name in config.json to the model class that implements it."""

from __future__ import annotations

from torch import nn

from kvforge.models.bert import BertForSequenceClassification, BertModel
from kvforge.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from kvforge.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from kvforge.models.gpt_oss import GptOssForCausalLM
from kvforge.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    Qwen3ForSequenceClassification,
)
from kvforge.models.mixtral import MixtralForCausalLM
from kvforge.models.qwen3_next import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM
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
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForCausalLM,  # its text model: images are not taken
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForCausalLM,
    "BertModel": BertModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    "Qwen3ForSequenceClassification": Qwen3ForSequenceClassification,
}

# The architectures the pooling runner runs (their attention runs without a KV cache): the encoders, the
# classifiers, and the decoders whose last (or mean) hidden state is an embedding (Qwen3-Embedding).
POOLING_ARCHITECTURES = frozenset({"BertModel", "BertForSequenceClassification", "Qwen3ForSequenceClassification",
                                   "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})


def resolve_model_class(hf_config: dict, runner: str = "generate") -> type[nn.Module]:
    """The class of the checkpoint's architecture, for the runner ("generate" or "pooling") that will run it."""
    architectures = hf_config.get("architectures") or []
    supported = MODEL_REGISTRY if runner == "generate" else POOLING_ARCHITECTURES
    for arch in architectures:
        if arch in supported:
            model_class = MODEL_REGISTRY[arch]
            if runner == "generate" and getattr(model_class, "is_pooling_only", False):
                raise ValueError(f"{arch} is a pooling model (embeddings, classification, scores): run it with "
                                 f"runner='pooling' (--runner pooling)")
            return model_class
    raise ValueError(
        f"unsupported architecture {architectures!r} for runner {runner!r}; supported: {sorted(supported)}"
    )


def is_pooling_architecture(hf_config: dict) -> bool:
    """Whether the checkpoint's architecture only pools (an encoder or a classifier): runner "auto" pools it."""
    return any(getattr(MODEL_REGISTRY.get(arch), "is_pooling_only", False)
               for arch in hf_config.get("architectures") or [])
