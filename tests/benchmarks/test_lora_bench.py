"""`kvforge bench lora` on the tiny model: all three runs report a rate, and the adapters it wrote are PEFT folders
that PEFT itself loads onto the base model."""

from __future__ import annotations

import json
from pathlib import Path

from kvforge.cli import main


def test_lora_bench_reports_every_run_and_writes_peft_adapters(tiny_llama_dir, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = tiny_llama_dir[0]
    out, adapters = tmp_path / "lora.json", tmp_path / "adapters"
    args = ["bench", "lora", "--model", str(folder), "--num-streams", "4", "--num-adapters", "2", "--lora-rank", "4",
            "--input-len", "8", "--output-len", "3", "--enforce-eager", "--kv-cache-memory", "16MiB",
            "--adapters-dir", str(adapters), "--json", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert all(result[f"{run}_tokens_per_s"] > 0 for run in ("base", "lora", "merged"))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), adapters / "adapter-1")
    assert sum(name.endswith("lora_B.default.weight") for name, _ in model.named_parameters()) == 2 * 7


def test_streams_must_divide_over_the_adapters(capsys) -> None:
    assert main(["bench", "lora", "--num-streams", "5", "--num-adapters", "2"]) == 2
    assert "--num-streams (5) must be a multiple of --num-adapters (2)" in capsys.readouterr().err
