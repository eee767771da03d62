"""`kvforge profile` from the command line: the table, and the JSON, trace and picture it writes."""

from __future__ import annotations

import gzip
import json

from kvforge.cli import main


def test_profile_command_writes_its_reports(tiny_llama_dir, tmp_path, capsys) -> None:
    out = tmp_path / "prof"
    workload = tmp_path / "w3.json"  # the tiny model's vocabulary is small: ids of its own
    workload.write_text(json.dumps({"prompts": [list(range(5, 5 + n)) for n in (9, 17, 24)], "n_new": 5}))
    code = main(["profile", "--model", str(tiny_llama_dir[0]), "--kv-cache-memory", "16MiB", "--enforce-eager",
                 "--workload", str(workload), "--concurrency", "2", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "decode steps:" in printed and "prefill steps:" in printed and "bound:" in printed
    report = json.loads((out / "profile.json").read_text())
    decode = report["summaries"]["0"]["decode"]
    assert decode["num_steps"] >= 4 and decode["mean_seqs"] <= 2  # at most 2 requests in flight
    assert {v["bound"] for v in decode["verdicts"]} <= {"compute", "memory", "overhead", "communication"}
    assert report["peaks"]["source"] == "measured"
    with gzip.open(out / "trace.json.gz", "rt") as trace:
        assert "kvforge:gemm.mlp" in trace.read()
    assert (out / "profile.png").stat().st_size > 10_000


def test_a_negative_concurrency_is_refused(tiny_llama_dir, tmp_path, capsys) -> None:
    code = main(["profile", "--model", str(tiny_llama_dir[0]), "--kv-cache-memory", "16MiB", "--concurrency", "-1",
                 "--out", str(tmp_path)])
    assert code == 2 and "--concurrency must be >= 0, got -1" in capsys.readouterr().err


def test_a_quantized_lm_head_is_profiled(tiny_llama_dir, tmp_path, capsys) -> None:
    out, workload = tmp_path / "prof", tmp_path / "w1.json"
    workload.write_text(json.dumps({"prompts": [list(range(5, 13))], "n_new": 3}))
    code = main(["profile", "--model", str(tiny_llama_dir[0]), "--kv-cache-memory", "16MiB", "--enforce-eager",
                 "--quantization", "w8a16", "--workload", str(workload), "--no-trace", "--out", str(out)])
    assert code == 0
    decode = json.loads((out / "profile.json").read_text())["summaries"]["0"]["decode"]
    head = next(v for v in decode["verdicts"] if v["label"] == "gemm.lm_head")
    config = json.loads((tiny_llama_dir[0] / "config.json").read_text())
    float_bytes = 4 * config["vocab_size"] * config["hidden_size"]
    assert 0.25 * float_bytes < head["bytes"] < 0.5 * float_bytes  # a step reads the int8 rows and their scales
