"""Tiny random-weight transformers models saved as HF checkpoint folders, with a small BPE tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB_SIZE = 512
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "def add(a, b):\n    return a + b  # 12345 67890",
    "Large language models generate text one token at a time, caching keys and values.",
]


def save_tokenizer(folder: Path, split: str | None = None) -> int:
    """A byte-level BPE of at most VOCAB_SIZE tokens trained on a few lines (the text split by the regex split before
    the byte-level mapping, if given; else by GPT-2's); returns its size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return len(fast)


# Gemma's tiny shapes: windows shorter than the prompts (ending mid-block), caps that bend the scores and logits,
# and (Gemma 3) local layers whose rope differs from the global ones'
_GEMMA = {
    "gemma2": dict(num_hidden_layers=4, head_dim=16, sliding_window=12, query_pre_attn_scalar=24,
                   attn_logit_softcapping=3.0, final_logit_softcapping=4.0, tie_word_embeddings=True),
    "gemma3": dict(num_hidden_layers=8, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                   tie_word_embeddings=True, rope_parameters={
                       "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}),
}
# GPT-OSS's tiny shapes: a window of 8 (ending mid-block), YaRN (its low frequencies slowed, cos and sin scaled),
# five experts (two a token) of MXFP4-sized rows (multiples of 32)
_GPT_OSS = dict(num_hidden_layers=4, head_dim=16, sliding_window=8, num_local_experts=5, num_experts_per_tok=2,
                intermediate_size=64, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                       "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                       "original_max_position_embeddings": 128})


def build_model(arch: str, **overrides):
    """A tiny random transformers model of the given family ('llama', 'mistral', 'qwen2', 'qwen3', 'gemma2',
    'gemma3', 'gpt_oss')."""
    import transformers

    common = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    common.update(_GEMMA.get(arch, _GPT_OSS if arch == "gpt_oss" else {}))
    common.update(overrides)
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    }[arch]
    torch.manual_seed(0)
    model = model_class(config_class(**common)).eval()
    if arch == "qwen2":  # make the QKV bias matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    if arch.startswith("gemma"):  # Gemma's norms start at w = 0 (a scale of 1 + w): make w matter
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                torch.nn.init.normal_(param, std=0.3)
    if arch == "gpt_oss":  # biases, sinks and clamps that matter: gate/up products past the SwiGLU limit of 7
        for name, param in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                torch.nn.init.normal_(param, std=0.5)
            elif name.endswith("experts.gate_up_proj"):
                torch.nn.init.normal_(param, std=0.6)
            elif name.endswith("experts.down_proj"):
                torch.nn.init.normal_(param, std=0.05)
    return model


# The tiny hybrid models (Gated DeltaNet + gated attention): Qwen3-Next, Qwen3.5 dense and Qwen3.5 MoE
HYBRID_COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
                     bos_token_id=1, eos_token_id=2, linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                     layer_types=["linear_attention", "full_attention", "linear_attention",
                                  "linear_attention"])  # fmt: skip
HYBRID_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48)
# arch -> (config class, model class, config overrides)
HYBRID_ARCHS = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(HYBRID_MOE, decoder_sparse_step=1, mlp_only_layers=[2])),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {}),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", HYBRID_MOE),
}


def build_hybrid_model(arch: str, vocab_size: int, **overrides):
    """A tiny random model whose norms, gates and routers are far from their initial values (a (1 + w) norm of
    w = 0 would not tell (1 + w) from w), and whose linear-attention states forget slowly; overrides: config
    entries."""
    import transformers

    config_name, model_name, arch_overrides = HYBRID_ARCHS[arch]
    config = getattr(transformers, config_name)(vocab_size=vocab_size,
                                                **{**HYBRID_COMMON, **arch_overrides, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("norm.weight"):
                tensor.normal_(0.0, 0.3)
            elif name.endswith("mlp.gate.weight"):
                tensor.normal_(0.0, 0.5)
            elif name.endswith("A_log"):  # slow decays (g of -0.02 to -0.2 a token): the state remembers far back
                tensor.uniform_(-4.0, -2.0)
    model.generation_config.eos_token_id = None  # NOTE: kvforge runs with ignore_eos; so does transformers
    return model


def save_model(folder: Path, arch: str, **overrides):
    """Save a tiny model and its tokenizer to folder; the model's vocabulary is the tokenizer's."""
    vocab_size = save_tokenizer(folder)
    model = build_model(arch, vocab_size=vocab_size, **overrides)
    model.save_pretrained(folder)
    return model


def save_mxfp4_experts(folder: Path, src: Path, model):
    """src's checkpoint (a tiny GPT-OSS) in folder with every expert weight in MXFP4 (blocks and scales, as GPT-OSS
    checkpoints store them); returns the transformers model whose experts are transformers' dequantization of those
    blocks and scales."""
    import copy
    import json
    import shutil

    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from kvforge.kernels.mxfp4 import quantize_mxfp4

    shutil.copytree(src, folder, dirs_exist_ok=True)
    (folder / "model.safetensors").unlink()
    reference = copy.deepcopy(model)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(tensor.transpose(1, 2))  # [experts, out, in / 32, 16]
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
            dequantized = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            reference.get_parameter(name).data.copy_(dequantized)
        else:
            tensors[name] = tensor.contiguous()
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["self_attn", "router", "embed_tokens", "lm_head"],
    }
    (folder / "config.json").write_text(json.dumps(config))
    return reference


def assert_logits_match(llm, model, prompts: list[list[int]]) -> None:
    """kvforge's fp32 logits at every position of each prompt within 1e-4 of the transformers model's."""
    for prompt in prompts:
        ours = llm.engine.score(prompt)
        with torch.no_grad():
            theirs = model(torch.tensor([prompt])).logits[0].float()
        assert (ours - theirs).abs().max().item() < 1e-4


def assert_matches_on_the_triton_kernels(folder: Path, model, prompts: list[list[int]],
                                         greedy: list[list[int]]) -> None:
    """An engine on the Triton kernels (interpreted on the CPU), prompts split into chunks of 16: every attention op
    on Triton, logits within 1e-4 of the transformers model's (assert_logits_match), and the first 4 of its greedy
    tokens (`greedy`, one list a prompt)."""
    from kvforge import LLM, SamplingParams

    llm = LLM(str(folder), kv_cache_memory="4MiB", kv_cache_dtype="float32", block_size=4, enforce_eager=True,
              attention_backend="triton", max_num_batched_tokens=16)  # fmt: skip
    assert {m.ops.backend for m in llm.engine.local_model.modules() if hasattr(m, "ops")} == {"triton"}
    assert_logits_match(llm, model, prompts)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outputs] == [t[:4] for t in greedy]
