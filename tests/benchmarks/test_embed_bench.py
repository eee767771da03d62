"""`kvforge bench embed` with small settings: the engines run, agree, and land in the JSON."""

from __future__ import annotations

import json
from pathlib import Path

from kvforge.cli import main


def test_small_embed_bench_times_all_and_they_agree(tmp_path: Path) -> None:
    out = tmp_path / "embed.json"
    assert main(["bench", "embed", "--num-sentences", "4", "--batch-sizes", "1", "4", "--vs-float32",
                 "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["batch_size"] for r in results] == [1, 4]
    for row in results:
        assert row["kvforge_sentences_per_s"] > 0 and row["sentence_transformers_sentences_per_s"] > 0
        assert row["min_cosine"] >= 0.9999
        assert row["float32_sentences_per_s"] > 0 and row["min_cosine_vs_float32"] >= 0.9999


def test_rejects_bad_batch_sizes_and_llama_cpp_arguments(capsys, tmp_path: Path) -> None:
    assert main(["bench", "embed", "--batch-sizes", "0"]) == 2
    assert "--batch-sizes" in capsys.readouterr().err
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert main(["bench", "embed", "--gguf", str(gguf)]) == 2
    assert "--llama-cpp-bin and --gguf go together" in capsys.readouterr().err
    assert main(["bench", "embed", "--gguf", str(gguf), "--llama-cpp-bin", str(tmp_path)]) == 2
    assert "has no llama-embedding" in capsys.readouterr().err
