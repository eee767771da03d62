"""Tiny random mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3): kvforge against
transformers, logits and greedy tokens; and the latent KV cache of the real DeepSeek-V3 configuration."""

from __future__ import annotations

import random

import pytest
import torch

from kvforge import LLM, SamplingParams
from kvforge.executor.kv_cache_memory import size_kv_cache
from kvforge.layers.kv_cache_spec import KVCacheSpec
from kvforge.layers.linear import Linear
from kvforge.models.registry import resolve_model_class
from tests.tiny_models import assert_logits_match, save_tokenizer

NUM_NEW = 16
PROMPT_LENS = [5, 17, 33, 1, 40, 12]
_COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
               bos_token_id=1, eos_token_id=2)  # fmt: skip
_DEEPSEEK = dict(
    num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
    moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
    qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
                     "beta_slow": 1, "original_max_position_embeddings": 128, "mscale": 1.0,
                     "mscale_all_dim": 0.707},
)  # fmt: skip
# arch -> (config class, model class, config overrides)
ARCHS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=6, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                       head_dim=16)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    dict(_DEEPSEEK, topk_method="group_limited_greedy", routed_scaling_factor=1.5)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(_DEEPSEEK, routed_scaling_factor=2.5)),
}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """NOTE: these tiny models gain nothing from a second thread, and on 2 cores shared with other jobs
    the threads' synchronisation made this module 5-10x slower (measured: 240 s against 30 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def build_moe_model(arch: str, vocab_size: int, **overrides):
    """A tiny random model whose routers are sharp enough (and DeepSeek-V3's correction bias non-zero) to
    send the tokens of one batch to different experts; overrides change its config."""
    import transformers

    config_name, model_name, extra = ARCHS[arch]
    config = getattr(transformers, config_name)(vocab_size=vocab_size, **{**_COMMON, **extra, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("mlp.gate.weight"):
                tensor.normal_(0.0, 0.5)
            elif name.endswith("e_score_correction_bias"):
                tensor.normal_(0.0, 0.1)
    model.generation_config.eos_token_id = None  # NOTE: kvforge runs with ignore_eos; so does transformers
    return model


@pytest.fixture(scope="module", params=list(ARCHS))
def tiny_moe(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model = build_moe_model(request.param, save_tokenizer(folder))
    model.save_pretrained(folder)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, model.config.vocab_size) for _ in range(n)] for n in PROMPT_LENS]
    prompts[5] = prompts[4][:36]  # shares two full blocks with prompts[4]
    expected = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW, do_sample=False, pad_token_id=0)
        expected.append(out[0, len(prompt) :].tolist())
    return folder, model, prompts, expected


def _generate(llm: LLM, prompts: list[list[int]]):
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def test_logits_greedy_and_prefix_cache(tiny_moe):
    folder, model, prompts, expected = tiny_moe
    # a float32 cache: the math against transformers' (the CPU's default float16 cache: test_kv_cache_dtype.py)
    llm = LLM(str(folder), kv_cache_memory="16MiB", kv_cache_dtype="float32")
    assert_logits_match(llm, model, prompts[:3] + prompts[4:5])
    assert [o.outputs[0].token_ids for o in _generate(llm, prompts)] == expected
    again = _generate(llm, prompts)  # every prompt's full leading blocks are cached now
    assert [o.outputs[0].token_ids for o in again] == expected
    assert again[4].num_cached_tokens == 32 and again[0].num_cached_tokens == 0
    cache = llm.engine.cache_stats()
    assert cache.num_free_blocks == cache.num_usable_blocks


def test_greedy_under_chunked_prefill(tiny_moe):
    folder, _, prompts, expected = tiny_moe
    llm = LLM(str(folder), kv_cache_memory="16MiB", max_num_batched_tokens=7)
    assert [o.outputs[0].token_ids for o in _generate(llm, prompts)] == expected


def test_deepseek_kv_cache_is_the_latent():
    """A DeepSeek token caches kv_lora_rank + qk_rope_head_dim values per layer: that is what the
    engine's sizing sees, and what the runner allocates."""
    hf_config = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 512, **_COMMON, **_DEEPSEEK}
    model = resolve_model_class(hf_config)(hf_config)
    spec = model.kv_cache_spec
    assert spec.layer_shapes == (((16 + 8,),),) * 3
    caches = spec.allocate(num_blocks=5, block_size=16, dtype=torch.float32, device=torch.device("cpu"))
    assert [tuple(c.shape) for layer in caches for c in layer] == [(5, 16, 24)] * 3


def test_real_deepseek_v3_kv_cache_per_token():
    """The real DeepSeek-V3 configuration (built on the meta device: no weights): its cache per token is
    61 layers x (512 + 64) bf16 values, over 10x smaller than full multi-head keys and values."""
    from transformers import DeepseekV3Config

    hf_config = DeepseekV3Config(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
    }).to_dict()  # fmt: skip
    hf_config["architectures"] = ["DeepseekV3ForCausalLM"]
    with torch.device("meta"):
        model = resolve_model_class(hf_config)(hf_config)
    bytes_per_token = model.kv_cache_spec.bytes_per_token(torch.bfloat16)
    assert bytes_per_token == (512 + 64) * 61 * 2
    full_mha = KVCacheSpec((((128, 128 + 64), (128, 128)),) * 61)  # keys qk_nope + qk_rope, values v
    assert full_mha.bytes_per_token(torch.bfloat16) >= 10 * bytes_per_token
    # 1 GiB holds 1 GiB / (16 tokens x 70,272 bytes) = 954 blocks of 16 tokens
    num_blocks = size_kv_cache(1024**3, 256, 4096, 16, bytes_per_token, []).num_blocks
    assert num_blocks == 1024**3 // (16 * bytes_per_token) == 954


def test_deepseek_on_the_triton_kernels(tmp_path):
    """The same model through the Triton kernels (interpreted on the CPU): fused MoE in every MoE layer,
    MLA decode over the latent cache at every decode step."""
    model = build_moe_model("deepseek_v3", save_tokenizer(tmp_path))
    model.save_pretrained(tmp_path)
    prompts = [[5, 9, 300, 41, 7], [100, 200, 17]]
    expected = [model.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False, pad_token_id=0)[0, len(p) :]
                .tolist() for p in prompts]  # fmt: skip
    llm = LLM(str(tmp_path), kv_cache_memory="4MiB", attention_backend="triton")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.parametrize("quantization", ["w8a16", "w8a8", "fp8"])
def test_deepseek_quantized_at_load(tmp_path, quantization: str):
    """Load-time quantization of DeepSeek: every linear but MLA's kv_b_proj (whose weight the absorbed
    decode multiplies with) and the head; logits stay within 5% of the float model's largest."""
    build_moe_model("deepseek_v3", save_tokenizer(tmp_path)).save_pretrained(tmp_path)
    tokens = list(range(5, 45))
    want = LLM(str(tmp_path), kv_cache_memory="4MiB").engine.score(tokens)
    llm = LLM(str(tmp_path), kv_cache_memory="4MiB", quantization=quantization)
    kernels = {name.rsplit(".", 1)[-1]: module.kernel.name for name, module in llm.engine.local_model.named_modules()
               if isinstance(module, Linear)}  # fmt: skip
    assert kernels["kv_b_proj"] == "float" and kernels["q_b_proj"] != "float" and kernels["o_proj"] != "float"
    got = llm.engine.score(tokens)
    assert 0 < (got - want).abs().max().item() < 0.05 * want.abs().max().item()
