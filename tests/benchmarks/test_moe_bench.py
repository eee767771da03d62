"""`kvforge bench moe --quick`: every implementation runs, agrees with the loop, and lands in the JSON."""

from __future__ import annotations

import json
from pathlib import Path

from kvforge.cli import main


def test_quick_moe_bench_reports_every_implementation(tmp_path: Path) -> None:
    out = tmp_path / "moe.json"
    assert main(["bench", "moe", "--quick", "--iters", "1", "--tokens", "1,5", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["num_tokens"], r["implementation"]) for r in rows} == {
        (n, impl) for n in (1, 5) for impl in ("loop", "fused", "sorted-slices", "gather-bmm", "kept-q8", "kept-q4")
    }
    assert all(r["ms"] > 0 for r in rows)


def test_rejects_bad_token_counts(capsys) -> None:
    assert main(["bench", "moe", "--quick", "--tokens", "0"]) == 2
    assert "--tokens" in capsys.readouterr().err
