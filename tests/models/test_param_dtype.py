"""Every model family builds its parameters in the dtype it is given (model_class(hf_config, dtype)), whatever torch's
default dtype is: a bfloat16 model built while torch's default is float64 holds bfloat16 weights, and float32 only
where the checkpoint's own float32 tensors are kept so (routers, attention sinks, GPT-OSS's expert biases) and in the
rope tables. The configs are transformers' own, with their defaults filled in."""

from __future__ import annotations

import pytest
import torch

from kvforge.models.registry import resolve_model_class

_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
_HYBRID = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"] * 2)  # fmt: skip
_DEEPSEEK = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                 first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
                 v_head_dim=12, n_group=2, topk_group=1)  # fmt: skip
# architecture -> (transformers config class, overrides)
FAMILIES = {
    "LlamaForCausalLM": ("LlamaConfig", {}),
    "Qwen3ForSequenceClassification": ("Qwen3Config", dict(num_labels=3)),
    "MixtralForCausalLM": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "Qwen2MoeForCausalLM": ("Qwen2MoeConfig", _MOE),
    "DeepseekV3ForCausalLM": ("DeepseekV3Config", _DEEPSEEK),
    "Gemma2ForCausalLM": ("Gemma2Config", dict(head_dim=16, sliding_window=32)),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=32)),
    "GptOssForCausalLM": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                                               sliding_window=32)),
    "Qwen3NextForCausalLM": ("Qwen3NextConfig", {**_MOE, **_HYBRID}),
    "Qwen3_5ForCausalLM": ("Qwen3_5TextConfig", _HYBRID),
    "BertForSequenceClassification": ("BertConfig", dict(num_labels=2, max_position_embeddings=64)),
}  # fmt: skip
# what stays float32 in a model of any dtype: the rope tables, the routers (their logits pick the experts), the
# attention sinks and GPT-OSS's expert biases (float32 in the checkpoints)
_FLOAT32 = ("cos_sin_cache", "mlp.gate.weight", "mlp.gate.bias", "e_score_correction_bias", "attn.sinks",
            "experts.gate_up_proj_bias", "experts.down_proj_bias")  # fmt: skip


@pytest.fixture
def default_float64():
    """torch's default dtype moved away from both the model's and float32, for the test's duration."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_parameters_in_the_given_dtype(arch, default_float64):
    import transformers

    config_name, overrides = FAMILIES[arch]
    hf_config = getattr(transformers, config_name)(**{**_COMMON, **overrides}, architectures=[arch]).to_dict()
    runner = "pooling" if "Classification" in arch else "generate"
    with torch.device("meta"):
        model = resolve_model_class(hf_config, runner)(hf_config, torch.bfloat16)
    tensors = [*model.named_parameters(), *model.named_buffers()]
    dtypes = {name: t.dtype for name, t in tensors if t.is_floating_point()}
    assert dtypes, arch
    wrong = {name: dtype for name, dtype in dtypes.items()
             if dtype != (torch.float32 if name.endswith(_FLOAT32) else torch.bfloat16)}  # fmt: skip
    assert not wrong, wrong
