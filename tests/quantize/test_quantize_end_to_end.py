"""`kvforge quantize` checkpoints of a tiny random Llama load back through LLM(model=folder) and give the
logits of the in-memory quantized model; `kvforge eval perplexity` runs end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvforge.cli import main
from kvforge.llm import LLM
from kvforge.quantize.checkpoint import checkpoint_tensors, write_checkpoint
from kvforge.quantize.quantizer import QuantizeOptions, fake_quantize, quantize_engine_model
from tests.tiny_models import save_model

TEXT = (
    "The river runs past the farms and the town. The baker lights the oven before dawn. "
    "Children skate on the frozen lake in winter, and the fishermen wait by their holes. "
) * 6
ENGINE = dict(dtype="float32", device="cpu", kv_cache_memory="8MiB")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_llama")
    save_model(folder, "llama", hidden_size=64, intermediate_size=128)
    return folder


@pytest.mark.parametrize(
    "options",
    [
        QuantizeOptions("gptq", 4, 32, sym=False, act_order=True, num_sequences=2, sequence_length=64),
        QuantizeOptions("gptq", 8, -1, sym=True, num_sequences=2, sequence_length=64),
        QuantizeOptions("awq", 4, 32, num_sequences=2, sequence_length=64),
        QuantizeOptions("rtn", 4, 64, sym=True),
        QuantizeOptions("w8a8", 8, num_sequences=2, sequence_length=64),
    ],
    ids=lambda o: f"{o.method}{o.bits}",
)
def test_checkpoint_loads_with_the_in_memory_logits(
    tiny_llama: Path, tmp_path: Path, options: QuantizeOptions
) -> None:
    llm = LLM(model=str(tiny_llama), **ENGINE)
    token_ids = llm.get_tokenizer().encode(TEXT)[:48]
    float_logits = llm.engine.score(token_ids)
    results = quantize_engine_model(llm.engine, options, [TEXT])
    config = options.config()
    tensors = checkpoint_tensors(llm.engine.local_model, results, config)
    write_checkpoint(tmp_path, llm.engine.hf_config, tensors, config, llm.get_tokenizer(), tiny_llama)
    fake_quantize(llm.engine, results)
    in_memory = llm.engine.score(token_ids)
    loaded = LLM(model=str(tmp_path), **ENGINE).engine.score(token_ids)
    quant_error = (in_memory - float_logits).abs().max().item()
    assert quant_error > 0  # the weights did change
    # NOTE: int4pack rounds activations to bfloat16 on the CPU, hence a tolerance, not equality.
    scale = float_logits.abs().max().item()
    assert (loaded - in_memory).abs().max().item() < 0.02 * scale
    assert (loaded.argmax(-1) == in_memory.argmax(-1)).float().mean() > 0.9


def _perplexity_command(capsys: pytest.CaptureFixture, model: Path, text_file: Path, *extra: str) -> float:
    """`kvforge eval perplexity` on text_file with small windows; the perplexity it prints."""
    args = ["eval", "perplexity", "--model", str(model), "--text", str(text_file), "--max-length", "32",
            "--stride", "16", "--kv-cache-memory", "8MiB", *extra]
    assert main(args) == 0
    return float(capsys.readouterr().out.split("perplexity ")[1].split()[0])


def test_quantize_and_eval_commands_run(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT)
    out = tmp_path / "gptq"
    assert (
        main(
            [
                "quantize",
                "--model",
                str(tiny_llama),
                "--method",
                "gptq",
                "--bits",
                "4",
                "--group-size",
                "32",
                "--act-order",
                "--out",
                str(out),
                "--calibration",
                str(text_file),
                "--num-sequences",
                "2",
                "--sequence-length",
                "64",
            ]
        )
        == 0
    )
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "gptq" and config["desc_act"] and config["group_size"] == 32
    assert (out / "tokenizer.json").is_file()
    quantized = _perplexity_command(capsys, out, text_file)
    online = _perplexity_command(capsys, tiny_llama, text_file, "--quantization", "w4a16")
    assert 1 < quantized < 2 * 512 and 1 < online < 2 * 512  # a random model over a 512-token vocabulary


def test_perplexity_covers_every_token_once(tiny_llama: Path) -> None:
    from kvforge.eval.perplexity import perplexity

    llm = LLM(model=str(tiny_llama), **ENGINE)
    token_ids = llm.get_tokenizer().encode(TEXT)[:100]
    whole = perplexity(llm.engine, token_ids, max_length=128, stride=128)
    windows = perplexity(llm.engine, token_ids, max_length=40, stride=20)
    assert whole.num_tokens == windows.num_tokens == 99
    logits = llm.engine.score(token_ids)
    nll = -torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(token_ids[1:])[:, None]).mean()
    assert abs(whole.perplexity - torch.exp(nll).item()) < 1e-3 * whole.perplexity
    assert windows.perplexity != whole.perplexity  # less context per token
