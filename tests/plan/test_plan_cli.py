"""`kvforge plan`: the table, the JSON, and exit code 2 with a clear message on bad input."""

from __future__ import annotations

import json

import pytest

from kvforge.cli import main


def test_table_lists_every_split_and_recommends_one(capsys):
    assert main(["plan", "--model", "llama-3-70b", "--devices", "8", "--device-type", "h200"]) == 0
    out = capsys.readouterr().out
    assert "llama-3-70b (LlamaForCausalLM): 70.55B parameters" in out
    assert "8 x H200 SXM 141GB" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["2"], ["4"], ["8"])]
    assert [(row[0], row[1]) for row in rows] == [("1", "8"), ("2", "4"), ("4", "2"), ("8", "1")]
    assert "recommended: TP=8 x PP=1" in out


def test_json_output(capsys):
    argv = ["plan", "--model", "deepseek-v3", "--devices", "8", "--device-type", "h200", "--context", "2048",
            "--batch", "64", "--json"]  # fmt: skip
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["precision"] == {"weight_dtype": "fp8", "kv_cache_dtype": "bf16"}
    assert plan["model"]["num_experts"] == 256
    assert len(plan["splits"]) == 4
    for split in plan["splits"]:
        assert split["batch"] == 64
        assert split["memory"]["total"] <= 0.9 * 139.8 * 2**30 * 1.0001
        assert split["decode"]["tokens_per_s"] > 0 and split["prefill"]["latency_ms"] > 0
    assert plan["recommended"] in [{"tp": s["tp"], "pp": s["pp"]} for s in plan["splits"]]


def test_default_model_on_the_cpu(capsys):
    assert main(["plan", "--device-type", "cpu", "--kv-cache-memory", "256MiB", "--context", "512"]) == 0
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct" in out and "weights fp32, KV cache fp16" in out
    assert "recommended: TP=1 x PP=1" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "llama-3-70b", "--device-type", "tpu-v9"], "unknown device type 'tpu-v9'"),
        (["--model", "llama-3-70b", "--devices", "0"], "--devices must be >= 1, got 0"),
        (["--model", "/nowhere/model"], "model '/nowhere/model' not found"),
        (["--model", "llama-3-70b", "--context", "100000"], "exceeds llama-3-70b's 8192 positions"),
        (["--model", "llama-3-70b", "--dtype", "int3"], "--dtype must be one of"),
        (["--model", "llama-3-70b", "--device-type", "cpu", "--devices", "2"], "no device-to-device interconnect"),
        (["--model", "deepseek-v3", "--kv-cache-dtype", "fp8"], "latent (MLA) KV cache"),
        (["--model", "llama-3-70b", "--kv-cache-memory", "lots"], "cannot parse memory size 'lots'"),
    ],
)
def test_bad_input_exits_2_with_a_message(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvforge: error: ") and message in err
