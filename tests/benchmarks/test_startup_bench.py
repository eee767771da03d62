"""`kvforge bench startup` on a tiny random Llama: each run's start-up, first token and whole generation."""

from __future__ import annotations

import json

from kvforge.cli import main


def test_startup_times_each_run_in_fresh_processes(tiny_llama_dir, tmp_path, capsys) -> None:
    out = tmp_path / "startup.json"
    code = main(["bench", "startup", "--runs", "2", "--max-tokens", "20", "--json", str(out), "--",
                 "--model", str(tiny_llama_dir[0]), "--kv-cache-memory", "8MiB"])
    assert code == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["run"] for r in runs] == [1, 2]
    for r in runs:
        assert 0 < r["ready_s"] < r["first_token_s"] and r["whole_ready_s"] < r["generate_20_s"]
    assert capsys.readouterr().out.count("first token") == 2
