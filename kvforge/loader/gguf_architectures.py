"""What each GGUF `general.architecture` that kvforge reads means in Hugging Face terms: one declaration per
architecture (ARCHITECTURES), read by loader/gguf.py.

    hf_architecture   the config.json `architectures` entry (and so the model class) it loads as
    layer_names       GGUF tensor kind of a layer (blk.{i}.<kind>.weight) -> its HF module under model.layers.{i};
                      "<kind>.<suffix>" -> an HF parameter of its own (GPT-OSS's sinks, Qwen3-Next's dt_bias)
    linear_kinds      the kinds that are linear layers' weights (kept in their quantized blocks by default)
    metadata          GGUF metadata key (after "<arch>.") -> config.json key (a dotted one nests: "rope_scaling.x")
    config            config.json entries the file does not record, fixed for the family
    derive            config.json entries llama.cpp computes from others rather than reading them from the file:
                      derive(config, metadata without the "<arch>." prefix, tensor shapes)
    regrouping        the layer tensors the converter split, merged or stacked unlike the checkpoints, and how they
                      go back (loader/gguf_regroup.py)

What llama.cpp's converter changed, undone on load:
    rope_permuted     q/k rows interleaved for its "normal" rope (Llama, Mistral); HF keeps rotate-half halves
    norm_offset       added to every RMSNorm weight (Gemma, Qwen3-Next, Qwen3.5: HF stores w of a scale 1 + w,
                      the file 1 + w), but those of plain_norms
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kvforge.loader.gguf_experts import GPT_OSS_EXPERTS
from kvforge.loader.gguf_hybrid_qwen import QWEN3_5_REGROUPING, QWEN3_NEXT_REGROUPING
from kvforge.loader.gguf_regroup import Regrouping
from kvforge.loader.gguf_stacked_experts import STACKED_EXPERTS

# The Llama layer: the tensor kinds llama.cpp's converter writes for it, and their HF modules.
_LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LINEAR_KINDS = frozenset({"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"})
# Gemma's four norms a layer: around the attention, and before and after the MLP ("ffn_norm" is the one before).
_GEMMA_LAYER = {
    **_LLAMA_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA_METADATA = {
    "attention.sliding_window": "sliding_window",
    "attention.sliding_window_pattern": "sliding_window_pattern",
    "final_logit_softcapping": "final_logit_softcapping",
}
# GPT-OSS: the second norm is llama.cpp's post_attention_norm; a sink logit a head; the router and the experts.
_GPT_OSS_LAYER = {
    **_LLAMA_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "attn_sinks.weight": "self_attn.sinks",  # a parameter of the attention, not a module
    "ffn_gate_inp": "mlp.router",
}


# Mixtral and the Qwen MoE families: the router and (Qwen2-MoE) a shared expert with its gate; the stacked routed
# experts are regrouped (gguf_stacked_experts.py)
_MOE_LAYER = {
    **_LLAMA_LAYER,
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_MOE_LINEAR_KINDS = _LINEAR_KINDS | {"ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"}
_QWEN_MOE_METADATA = {
    "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}  # fmt: skip


Shapes = dict[str, tuple[int, ...]]  # GGUF tensor name -> its shape


def _gemma_query_scalar(config: dict[str, Any], meta: dict[str, Any], shapes: Shapes) -> dict[str, Any]:
    """query_pre_attn_scalar, which the files do not record: llama.cpp takes head_dim, except for the 27B models
    (46 layers for Gemma 2, 62 for Gemma 3), whose scalar is hidden_size / num_attention_heads."""
    if config["num_hidden_layers"] == {"gemma2": 46, "gemma3_text": 62}[config["model_type"]]:
        return {"query_pre_attn_scalar": config["hidden_size"] // config["num_attention_heads"]}
    return {"query_pre_attn_scalar": config["head_dim"]}


def _gemma3_windows(config: dict[str, Any], meta: dict[str, Any], shapes: Shapes) -> dict[str, Any]:
    """A Gemma 3 file without a sliding window runs every layer globally (llama.cpp: no SWA)."""
    scalar = _gemma_query_scalar(config, meta, shapes)
    if config.get("sliding_window"):
        return scalar
    return {**scalar, "layer_types": ["full_attention"] * config["num_hidden_layers"]}


def _qwen3_next_layers(config: dict[str, Any], meta: dict[str, Any], shapes: Shapes) -> dict[str, Any]:
    """Qwen3-Next's value head size (the file has value heads and their total), rotary fraction (the file has the
    rotated channels), layer kinds (a recurrent flag a layer) and dense-MLP layers (those without experts)."""
    num_layers = config["num_hidden_layers"]
    derived = {
        "linear_value_head_dim": meta["ssm.inner_size"] // config["linear_num_value_heads"],
        "partial_rotary_factor": meta.get("rope.dimension_count", config["head_dim"]) / config["head_dim"],
        "mlp_only_layers": [i for i in range(num_layers) if f"blk.{i}.ffn_gate_exps.weight" not in shapes],
    }
    if "attention.recurrent_layers" in meta:
        derived["layer_types"] = ["linear_attention" if recurrent else "full_attention"
                                  for recurrent in meta["attention.recurrent_layers"][:num_layers]]  # fmt: skip
    return derived


def _mixtral(config: dict[str, Any], meta: dict[str, Any], shapes: Shapes) -> dict[str, Any]:
    """A llama file with experts is a Mixtral (llama.cpp writes Mixtral as llama, its experts stacked)."""
    if "expert_count" not in meta:
        return {}
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "num_local_experts": meta["expert_count"], "num_experts_per_tok": meta["expert_used_count"]}  # fmt: skip


def _sparse_layers(config: dict[str, Any], meta: dict[str, Any], shapes: Shapes) -> dict[str, Any]:
    """The Qwen MoE layers without experts run a dense MLP."""
    return {"mlp_only_layers": [i for i in range(config["num_hidden_layers"])
                                if f"blk.{i}.ffn_gate_exps.weight" not in shapes]}  # fmt: skip


@dataclass(frozen=True, slots=True)
class GGUFArchitecture:
    """One GGUF architecture in Hugging Face terms (the module docstring)."""

    hf_architecture: str
    model_type: str
    layer_names: Mapping[str, str] = field(default_factory=lambda: MappingProxyType(_LLAMA_LAYER))
    linear_kinds: frozenset[str] = _LINEAR_KINDS
    metadata: Mapping[str, str] = field(default_factory=dict)
    config: Mapping[str, Any] = field(default_factory=lambda: {"hidden_act": "silu"})
    derive: Callable[[dict[str, Any], dict[str, Any], Shapes], dict[str, Any]] | None = None
    regrouping: Regrouping | None = None
    rope_permuted: bool = False
    norm_offset: float = 0.0
    plain_norms: tuple[str, ...] = ()  # HF names (their endings) of norms the converter left as they were


_GEMMA2 = GGUFArchitecture(
    "Gemma2ForCausalLM", "gemma2", _GEMMA_LAYER,
    metadata={**_GEMMA_METADATA, "attn_logit_softcapping": "attn_logit_softcapping"},
    config={"hidden_activation": "gelu_pytorch_tanh", "sliding_window": 4096},  # llama.cpp's default window
    derive=_gemma_query_scalar, norm_offset=1.0,
)  # fmt: skip
_GEMMA3 = GGUFArchitecture(
    "Gemma3ForCausalLM", "gemma3_text", _GEMMA_LAYER,
    metadata={**_GEMMA_METADATA, "rope.freq_base_swa": "rope_local_base_freq"},
    config={"hidden_activation": "gelu_pytorch_tanh"}, derive=_gemma3_windows, norm_offset=1.0,
)  # fmt: skip
_GPT_OSS = GGUFArchitecture(
    "GptOssForCausalLM", "gpt_oss", _GPT_OSS_LAYER,
    metadata={"attention.sliding_window": "sliding_window",
              "attention.sliding_window_pattern": "sliding_window_pattern",
              "expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok",
              "expert_feed_forward_length": "intermediate_size",
              "rope.scaling.yarn_beta_fast": "rope_scaling.beta_fast",
              "rope.scaling.yarn_beta_slow": "rope_scaling.beta_slow"},
    # NOTE: GPT-OSS's YaRN keeps its blend's edges unrounded, which the files do not say (config.json does)
    config={"hidden_act": "silu", "rope_scaling": {"truncate": False}}, regrouping=GPT_OSS_EXPERTS,
)  # fmt: skip

# Qwen3-Next and Qwen3.5: gated attention (q_proj rows per head [query, gate]) or Gated DeltaNet per layer, MoE with
# a gated shared expert or dense MLPs (Qwen3.5 dense); the tensors the converter changed: gguf_hybrid_qwen.py
_QWEN3_NEXT_LAYER = {
    **_LLAMA_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_HYBRID_METADATA = {
    "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    "ssm.conv_kernel": "linear_conv_kernel_dim", "ssm.state_size": "linear_key_head_dim",
    "ssm.group_count": "linear_num_key_heads", "ssm.time_step_rank": "linear_num_value_heads",
    "full_attention_interval": "full_attention_interval",
}  # fmt: skip


def _hybrid(hf_architecture: str, model_type: str, regrouping: Regrouping) -> GGUFArchitecture:
    """Qwen3-Next and Qwen3.5 (dense and MoE): their norms stored as 1 + w but the Gated DeltaNet's output norm."""
    return GGUFArchitecture(hf_architecture, model_type, _QWEN3_NEXT_LAYER, metadata=_HYBRID_METADATA,
                            derive=_qwen3_next_layers, regrouping=regrouping, norm_offset=1.0,
                            plain_norms=("linear_attn.norm.weight",))  # fmt: skip


ARCHITECTURES: Mapping[str, GGUFArchitecture] = MappingProxyType({
    "llama": GGUFArchitecture("LlamaForCausalLM", "llama", _MOE_LAYER, derive=_mixtral, regrouping=STACKED_EXPERTS,
                              rope_permuted=True),
    "mistral": GGUFArchitecture("MistralForCausalLM", "mistral", rope_permuted=True),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", "qwen2"),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", "qwen3"),
    # llama.cpp renormalizes Qwen3-MoE's top-k routing weights (norm_topk_prob), not Qwen2-MoE's
    "qwen2moe": GGUFArchitecture("Qwen2MoeForCausalLM", "qwen2_moe", _MOE_LAYER, _MOE_LINEAR_KINDS,
                                 _QWEN_MOE_METADATA, {"hidden_act": "silu", "norm_topk_prob": False},
                                 _sparse_layers, STACKED_EXPERTS),
    "qwen3moe": GGUFArchitecture("Qwen3MoeForCausalLM", "qwen3_moe", _MOE_LAYER, _MOE_LINEAR_KINDS,
                                 _QWEN_MOE_METADATA, {"hidden_act": "silu", "norm_topk_prob": True},
                                 _sparse_layers, STACKED_EXPERTS),
    "gemma2": _GEMMA2,
    "gemma3": _GEMMA3,
    "gpt-oss": _GPT_OSS,
    "qwen3next": _hybrid("Qwen3NextForCausalLM", "qwen3_next", QWEN3_NEXT_REGROUPING),
    "qwen35": _hybrid("Qwen3_5ForCausalLM", "qwen3_5_text", QWEN3_5_REGROUPING),
    "qwen35moe": _hybrid("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", QWEN3_5_REGROUPING),
})  # fmt: skip
