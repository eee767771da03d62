"""GPTQ and AWQ 4-bit stay closer to the float model than round-to-nearest on every held-out text, and
8-bit weights barely move it: a tiny random Llama whose norms have a few outlier channels (as trained
models do), calibrated on the shipped calibration set and evaluated on the shipped held-out texts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvforge.eval.perplexity import default_evaluation_texts
from kvforge.llm import LLM
from kvforge.quantize.calibration import default_calibration_texts
from kvforge.quantize.quantizer import QuantizeOptions, fake_quantize, quantize_engine_model
from tests.tiny_models import build_model, save_tokenizer

ENGINE = dict(dtype="float32", device="cpu", kv_cache_memory="16MiB")
EVAL_TOKENS = 256


@pytest.fixture(scope="module")
def outlier_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("outlier_llama")
    vocab_size = save_tokenizer(folder)
    model = build_model("llama", vocab_size=vocab_size, hidden_size=128, intermediate_size=256,
                        num_attention_heads=4, num_key_value_heads=4)  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                outliers = torch.randperm(128, generator=generator)[:4]
                norm.weight[outliers] *= 20
    model.save_pretrained(folder)
    return folder


def _log_probs(llm: LLM, texts: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    return {name: torch.log_softmax(llm.engine.score(ids), dim=-1) for name, ids in texts.items()}


def _kl_from(reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> dict[str, float]:
    """Mean KL(reference || other) of the next-token distributions, per text."""
    return {name: (ref.exp() * (ref - other[name])).sum(-1).mean().item() for name, ref in reference.items()}


@pytest.mark.parametrize("group_size", [32, 64])
def test_gptq_and_awq_beat_rtn_on_every_held_out_text(outlier_llama: Path, group_size: int) -> None:
    llm = LLM(model=str(outlier_llama), **ENGINE)
    tokenizer = llm.get_tokenizer()
    texts = {name: tokenizer.encode(text)[:EVAL_TOKENS] for name, text in default_evaluation_texts().items()}
    assert len(texts) >= 3 and "code" in texts
    reference = _log_probs(llm, texts)
    calibration = default_calibration_texts()
    errors = {}
    for method, bits in (("rtn", 4), ("gptq", 4), ("awq", 4), ("rtn", 8)):
        llm = LLM(model=str(outlier_llama), **ENGINE)
        options = QuantizeOptions(method, bits, group_size, act_order=method == "gptq", num_sequences=32,
                                  sequence_length=128)  # fmt: skip
        fake_quantize(llm.engine, quantize_engine_model(llm.engine, options, calibration))
        errors[f"{method}{bits}"] = _kl_from(reference, _log_probs(llm, texts))
    for name in texts:
        assert errors["gptq4"][name] < 0.9 * errors["rtn4"][name], (name, errors)
        assert errors["awq4"][name] < 0.9 * errors["rtn4"][name], (name, errors)
        assert errors["rtn8"][name] < 0.05 * errors["rtn4"][name], (name, errors)
