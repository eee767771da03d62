"""The shipped calibration set and held-out texts, seeded sequence sampling, and the CLI's handling of
calibration files and group sizes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvforge.cli import main
from kvforge.eval.perplexity import default_evaluation_texts
from kvforge.loader.default_model import default_model_path
from kvforge.loader.gguf_file import GGUFFile
from kvforge.quantize.calibration import calibration_sequences, default_calibration_texts
from kvforge.tokenizer import Tokenizer
from tests.tiny_models import save_model


def test_shipped_calibration_set_is_large_and_disjoint_from_the_held_out_texts() -> None:
    tokenizer = Tokenizer.from_gguf(GGUFFile(default_model_path()).metadata)
    calibration = default_calibration_texts()
    assert len(calibration) >= 5  # prose, technical, code, markup, dialogue
    assert sum(len(tokenizer.encode(text)) for text in calibration) >= 64_000
    held_out = default_evaluation_texts()
    assert {"prose", "licence", "code"} <= set(held_out)
    joined = "\n".join(calibration)
    for name, text in held_out.items():
        lines = [line for line in text.splitlines() if len(line.strip()) > 40]
        assert lines and not any(line in joined for line in lines), name


def test_sequences_start_at_seeded_random_positions() -> None:
    token_ids = list(range(10_000))
    first = calibration_sequences(token_ids, 512, 16, seed=0)
    assert first == calibration_sequences(token_ids, 512, 16, seed=0)
    assert first != calibration_sequences(token_ids, 512, 16, seed=1)
    assert len(first) == 16 and all(len(s) == 512 and s == list(range(s[0], s[0] + 512)) for s in first)
    assert len({s[0] for s in first}) == 16 and max(s[0] for s in first) > 5_000
    assert calibration_sequences(token_ids[:100], 512, 16) == [token_ids[:100]]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_llama")
    save_model(folder, "llama", hidden_size=64, intermediate_size=128)
    return folder


def test_group_size_that_does_not_divide_a_width_is_a_one_line_error(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    args = ["quantize", "--model", str(tiny_llama), "--method", "gptq", "--group-size", "128", "--out",
            str(tmp_path / "q"), "--num-sequences", "1", "--sequence-length", "16"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("kvforge: error: group size 128") and "16, 32, 64, -1" in err
    assert not (tmp_path / "q").exists()


def test_several_calibration_files_and_a_missing_one(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    files = [tmp_path / "a.txt", tmp_path / "b.txt"]
    files[0].write_text("The lighthouse keeper climbs the stairs at dusk. " * 20)
    files[1].write_text("def area(r):\n    return 3.14159 * r * r\n" * 20)
    base = ["quantize", "--model", str(tiny_llama), "--method", "awq", "--group-size", "32",
            "--num-sequences", "4", "--sequence-length", "32"]  # fmt: skip
    calibration = [arg for f in files for arg in ("--calibration", str(f))]
    assert main([*base, "--out", str(tmp_path / "q"), *calibration]) == 0
    assert "peak memory" in capsys.readouterr().out
    missing = ["--calibration", str(tmp_path / "missing.txt")]
    assert main([*base, "--out", str(tmp_path / "q2"), *missing]) == 2
    assert "missing.txt" in capsys.readouterr().err


def test_eval_reports_each_text_and_the_mean(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    files = [tmp_path / "one.txt", tmp_path / "two.txt"]
    files[0].write_text("The quick brown fox jumps over the lazy dog. " * 8)
    files[1].write_text("Paris is the capital of France. " * 8)
    args = ["eval", "perplexity", "--model", str(tiny_llama), "--max-length", "32", "--stride", "16",
            "--kv-cache-memory", "8MiB", "--text", str(files[0]), "--text", str(files[1])]  # fmt: skip
    assert main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    values = [float(line.split("perplexity ")[1].split()[0]) for line in lines]
    assert lines[0].startswith("one.txt: ") and lines[1].startswith("two.txt: ")
    assert lines[2].startswith("mean perplexity") and abs(values[2] - (values[0] + values[1]) / 2) < 1e-3
