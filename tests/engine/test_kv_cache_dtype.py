"""The engine with a 16-bit (the CPU's default) or quantized KV cache (kv_cache_dtype="int8" / "fp8"): more tokens in
the same byte budget than float32, logits close to the float32 cache's, and mostly the same greedy tokens."""

from __future__ import annotations

import pytest
import torch

from kvforge import LLM, SamplingParams
from kvforge.config import CacheConfig
from kvforge.engine_args import build_engine_config
from kvforge.layers.kv_cache_spec import KVCacheSpec
from kvforge.models.registry import resolve_model_class
from tests.models.test_moe_vs_transformers import _COMMON, _DEEPSEEK

TEXT = (
    "The river runs past the farms and the town. The baker lights the oven before dawn. "
    "Children skate on the frozen lake in winter, and the fishermen wait by their holes. "
) * 6
PROMPTS = ["The quick brown fox", "Paris is the capital of", "def add(a, b):", "Large language models",
           "Berlin is", "The lazy dog", "return a + b", "caching keys and values"]
GREEDY = SamplingParams(max_tokens=32, temperature=0)


@pytest.fixture(scope="module")
def float32_llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir[0]), kv_cache_memory="16MiB", kv_cache_dtype="float32")


@pytest.fixture(scope="module")
def float_run(float32_llm: LLM) -> tuple[list[int], torch.Tensor, list[list[int]]]:
    """(scored token ids, their logits, greedy tokens of PROMPTS) with the float32 cache."""
    token_ids = float32_llm.get_tokenizer().encode(TEXT)[:200]
    tokens = [o.outputs[0].token_ids for o in float32_llm.generate(PROMPTS, GREEDY)]
    return token_ids, float32_llm.engine.score(token_ids), tokens


@pytest.fixture(scope="module")
def int8_llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir[0]), kv_cache_memory="16MiB", kv_cache_dtype="int8")


def test_bad_kv_cache_dtype_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        build_engine_config(kv_cache_dtype="float64")
    assert build_engine_config(kv_cache_dtype="fp8").cache.kv_cache_dtype == "fp8"


def test_quantized_spec_sizes_and_allocates_codes_and_scales() -> None:
    spec = KVCacheSpec.key_value(num_layers=2, num_kv_heads=3, head_dim=64)
    int8 = spec.with_kv_cache_dtype("int8", torch.float32, True)
    # per token, layer and K/V: 3 heads x (64 one-byte codes + one 4-byte scale)
    assert int8.bytes_per_token(torch.float32) == int8.bytes_per_token(torch.float16) == 2 * 2 * 3 * (64 + 4)
    assert spec.bytes_per_token(torch.float16) / int8.bytes_per_token(torch.float16) == pytest.approx(1.88, abs=0.01)
    assert spec.bytes_per_token(torch.float32) / int8.bytes_per_token(torch.float32) == pytest.approx(3.76, abs=0.01)
    assert spec.with_kv_cache_dtype("auto", torch.bfloat16).bytes_per_token(torch.bfloat16) == 2 * 2 * 3 * 64 * 2
    caches = int8.allocate(num_blocks=5, block_size=16, dtype=torch.float32, device=torch.device("cpu"))
    assert [[(tuple(t.shape), t.dtype) for t in layer] for layer in caches] == [[
        ((5, 16, 3, 64), torch.int8), ((5, 16, 3, 64), torch.int8),
        ((5, 16, 3), torch.float32), ((5, 16, 3), torch.float32),
    ]] * 2  # fmt: skip
    fp8 = spec.with_kv_cache_dtype("fp8", torch.bfloat16, True).allocate(2, 16, torch.bfloat16, torch.device("cpu"))
    assert fp8[0][0].dtype == torch.float8_e4m3fn and fp8[0][2].dtype == torch.float32


def test_latent_attention_models_reject_a_quantized_cache() -> None:
    hf_config = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 512, **_COMMON, **_DEEPSEEK}
    spec = resolve_model_class(hf_config)(hf_config).kv_cache_spec
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        spec.with_kv_cache_dtype("int8", torch.float32, True)
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        spec.with_kv_cache_dtype("float16", torch.float32, True)
    assert spec.with_kv_cache_dtype("auto", torch.float32, True).bytes_per_token(torch.float32) == spec.bytes_per_token(
        torch.float32)  # the latent cache stays in the model dtype


def test_int8_and_16_bit_caches_fit_more_tokens_in_the_same_budget(float32_llm: LLM, tiny_llm: LLM, int8_llm: LLM
                                                                   ) -> None:
    """The tiny Llama (head_dim 16, fp32): 2 x 2 layers x 2 heads x 16 x 4 bytes = 512 bytes a token in
    float32, 256 in float16 (the CPU's default), 2 x 2 x 2 x (16 + 4) = 160 as int8 codes and scales, in the same
    16 MiB."""
    float_tokens = float32_llm.engine.cache_stats().capacity_tokens
    assert tiny_llm.engine.cache_stats().capacity_tokens / float_tokens == pytest.approx(2, rel=0.01)
    assert tiny_llm.engine.config.cache.kv_cache_dtype == "auto"
    int8_tokens = int8_llm.engine.cache_stats().capacity_tokens
    assert int8_tokens / float_tokens == pytest.approx(512 / 160, rel=0.01)


def test_float16_cache_logits_and_greedy_tokens_match_the_float32_cache(float_run, tiny_llm: LLM) -> None:
    """The CPU's default cache: keys and values rounded to float16 (11 bits), widened as the kernels read them."""
    token_ids, float_logits, float_tokens = float_run
    logits = tiny_llm.engine.score(token_ids)
    assert (logits - float_logits).abs().max().item() < 2e-3 * float_logits.abs().max().item()
    assert (logits.argmax(-1) == float_logits.argmax(-1)).float().mean().item() > 0.99
    tokens = [o.outputs[0].token_ids for o in tiny_llm.generate(PROMPTS, GREEDY)]
    assert sum(a == b for a, b in zip(tokens, float_tokens, strict=True)) >= 7


def test_int8_cache_logits_and_greedy_tokens_match_the_float_cache(float_run, int8_llm: LLM) -> None:
    token_ids, float_logits, float_tokens = float_run
    logits = int8_llm.engine.score(token_ids)
    # measured: max |diff| 2.0e-3 with logits up to 0.63 (0.3%); 99.5% of the 200 argmaxes agree
    assert (logits - float_logits).abs().max().item() < 0.01 * float_logits.abs().max().item()
    assert (logits.argmax(-1) == float_logits.argmax(-1)).float().mean().item() > 0.97
    # measured: 7 of 8 prompts give the same 32 greedy tokens, the other diverges at token 9 (the tiny
    # random model's logits are nearly flat, so a near-tie can flip)
    tokens = [o.outputs[0].token_ids for o in int8_llm.generate(PROMPTS, GREEDY)]
    assert sum(a == b for a, b in zip(tokens, float_tokens, strict=True)) >= 6
    assert all(a[:4] == b[:4] for a, b in zip(tokens, float_tokens, strict=True))


def test_fp8_cache_logits_stay_close(tiny_llama_dir, float_run) -> None:
    token_ids, float_logits, _ = float_run
    llm = LLM(str(tiny_llama_dir[0]), kv_cache_memory="16MiB", kv_cache_dtype="fp8")
    logits = llm.engine.score(token_ids)
    # measured: max |diff| 1.3e-2 (2% of the largest logit); 98.5% of the argmaxes agree
    assert (logits - float_logits).abs().max().item() < 0.05 * float_logits.abs().max().item()
    assert (logits.argmax(-1) == float_logits.argmax(-1)).float().mean().item() > 0.95
