"""`kvforge bench kernels --quick` runs end to end and writes its JSON report."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from kvforge.benchmarks.kernels import KERNELS, add_arguments, run


def test_quick_run_writes_json(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--quick", "--backend", "triton", "--iters", "1", "--out", str(tmp_path)])
    assert run(args) == 0
    report = json.loads((tmp_path / "kernels.json").read_text())
    rows = report["rows"]
    assert {row["kernel"] for row in rows} == set(KERNELS)
    assert {row["impl"] for row in rows} == {"triton", "baseline"}
    assert all(row["ms"] > 0 and math.isfinite(row["roofline_fraction"]) for row in rows)
    assert report["peaks"]["bandwidth_gbs"] > 0 and report["peaks"]["tflops"] > 0
