"""`kvforge bench speculative` on a tiny random Llama: every method, stream count and round reported."""

from __future__ import annotations

import json
from pathlib import Path

from kvforge.cli import main


def test_rounds_alternate_methods_and_report_each_round(tiny_llama_dir: tuple[Path, object], tmp_path: Path) -> None:
    out = tmp_path / "spec.json"
    code = main(["bench", "speculative", "--model", str(tiny_llama_dir[0]), "--methods", "off,ngram,suffix",
                 "--workloads", "grounded", "--streams", "1,2", "--num-prompts", "2", "--output-len", "6",
                 "--rounds", "2", "--enforce-eager", "--kv-cache-memory", "16MiB", "--json", str(out)])
    result = json.loads(out.read_text())
    assert code == 0 and result["rounds"] == 2
    rows = {(r["streams"], r["method"]): r for r in result["rows"]}
    assert set(rows) == {(s, m) for s in (1, 2) for m in ("off", "ngram", "suffix")}
    for (_, method), row in rows.items():
        assert row["tokens_per_s"] > 0 and len(row["vs_off_per_round"]) == 2
        if method == "off":
            assert row["vs_off"] == 1.0 and row["vs_off_per_round"] == [1.0, 1.0]


def test_rounds_must_be_positive(tiny_llama_dir: tuple[Path, object], tmp_path: Path, capsys) -> None:
    code = main(["bench", "speculative", "--model", str(tiny_llama_dir[0]), "--rounds", "0"])
    assert code == 2 and "--rounds" in capsys.readouterr().err


def test_the_baseline_comes_first(tiny_llama_dir: tuple[Path, object], capsys) -> None:
    code = main(["bench", "speculative", "--model", str(tiny_llama_dir[0]), "--methods", "ngram,off"])
    assert code == 2 and "--methods must start with off" in capsys.readouterr().err
