"""`kvforge bench startup`: `kvforge generate` cold and warm in fresh processes, and llama.cpp's completion tool timed
beside it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvforge.benchmarks.startup import llama_cpp_rows
from kvforge.cli import main


def test_kvforge_generate_runs_cold_then_warm(tiny_llama_dir, tmp_path, capsys, monkeypatch) -> None:
    # NOTE: the torch fallbacks: with the C++ kernels, the cold runs would compile them (minutes) in their empty caches
    monkeypatch.setenv("KVFORGE_NO_CPU_EXTENSION", "1")
    out = tmp_path / "startup.json"
    code = main(["bench", "startup", "--model", str(tiny_llama_dir[0]), "--max-tokens", "12", "--json", str(out),
                 "--", "--kv-cache-memory", "8MiB"])
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["runner"], r["run"]) for r in rows] == [("kvforge generate", "cold"), ("kvforge generate", "warm")]
    for r in rows:
        # NOTE: ready and first token are one process's (a 1-token run), whole another's (the 12-token run): on a
        # loaded machine the second may end sooner than the first, so only the first two are ordered
        assert 0 < r["ready_s"] < r["first_token_s"] and r["whole_s"] > 0
    table = capsys.readouterr().out
    assert "| kvforge generate | cold |" in table and "12 tokens, to exit (s)" in table


def test_llama_cpp_is_timed_to_its_first_output_and_exit(tmp_path: Path) -> None:
    """A stand-in for llama-completion that answers its first token 0.3 s after it starts, its last 0.3 s later."""
    tool = tmp_path / "llama-completion"
    tool.write_text(f"#!{sys.executable}\nimport sys, time\nopen(sys.argv[0] + '.args', 'w').write(' '.join("
                    "sys.argv[1:]))\ntime.sleep(0.3)\nprint('Once', end='', flush=True)\ntime.sleep(0.3)\n"
                    "print(' upon')\n")
    tool.chmod(0o755)
    rows = llama_cpp_rows(str(tool), "model.gguf", "A story", 2, 1, 3)
    assert [(r.runner, r.run) for r in rows] == [("llama.cpp llama-completion", "cold"),
                                                 ("llama.cpp llama-completion", "warm")]
    for r in rows:
        assert r.first_token_s >= 0.3 and r.whole_s >= r.first_token_s + 0.3
    args = (tmp_path / "llama-completion.args").read_text()
    assert args.startswith("-m model.gguf -p A story -n 2 -t 3 --temp 0 --ignore-eos")


@pytest.mark.parametrize("flag", [["--llama-cpp", "."], ["--warm-runs", "-1"]])
def test_bad_settings_are_one_line_errors(tmp_path, capsys, flag: list[str]) -> None:
    assert main(["bench", "startup", "--model", str(tmp_path / "model.gguf"), *flag]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("kvforge: error:") and len(error.splitlines()) == 1
