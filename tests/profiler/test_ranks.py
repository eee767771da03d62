"""Under tensor and pipeline parallelism (Gloo on the CPU, one process per rank) every rank records its own
timeline, and the communication it does shows up in it."""

from __future__ import annotations

import pytest

from kvforge.benchmarks.workload import random_workload
from kvforge.profiler.cli import profile_workload
from kvforge.profiler.report import format_table, merged_by_step

WORKLOAD = random_workload(3, (8, 24), 6, seed=0, vocab_range=(5, 300))


def _seconds(steps, label: str) -> float:
    return sum(s.seconds.get(label, 0.0) for s in steps)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_every_rank_records_its_communication(tiny_llama_dir, tmp_path, tp: int, pp: int) -> None:
    kwargs = {"model": str(tiny_llama_dir[0]), "kv_cache_memory": "16MiB", "tensor_parallel_size": tp,
              "pipeline_parallel_size": pp}
    profile = profile_workload(kwargs, WORKLOAD, concurrency=0, out=tmp_path, trace=False)
    assert sorted(profile.ranks) == [0, 1]
    driver, other = profile.ranks[0], profile.ranks[1]
    assert len(other) >= len(driver) >= 6  # each step of the driver runs one batch (pp: up to 2) on each rank
    for steps in (driver, other):
        assert sum(s.model_s for s in steps) > 0 and {s.kind for s in steps} >= {"prefill", "decode"}
    if tp == 2:  # the row-parallel layers' all-reduce, on both ranks
        assert _seconds(driver, "communication") > 0 and _seconds(other, "communication") > 0
    else:  # stage 0 sends its hidden states on; stage 1 waits for them, and the driver for its tokens
        assert _seconds(driver, "communication") > 0
        assert _seconds(other, "pipeline_wait") > 0 and _seconds(driver, "pipeline_wait") > 0
    merged = merged_by_step(profile)
    assert len(merged) == len(driver) and all(set(m["ranks"]) == {0, 1} for m in merged)
    assert sum(m["ranks"][1]["wall_s"] for m in merged) == pytest.approx(sum(s.wall_s for s in other))
    assert "pipeline wait ms" in format_table(profile)
    assert (tmp_path / "ranks" / "trace.rank1.json.gz").is_file()
