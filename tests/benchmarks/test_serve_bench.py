"""`kvforge bench serve` against the real server on a tiny random Llama."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvforge.benchmarks import serve
from kvforge.cli import main
from tests.server.harness import API_KEY, ServerThread, start_tiny_server


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir: tuple[Path, object]) -> Path:
    return tiny_llama_dir[0]


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerThread]:
    server = start_tiny_server(model_dir)
    yield server
    server.stop()


def _bench(server: ServerThread, tmp_path: Path, *flags: str) -> tuple[int, dict]:
    out = tmp_path / "result.json"
    code = main(["bench", "serve", "--base-url", f"{server.base_url}/v1", "--api-key", API_KEY,
                 "--out", str(out), *flags])
    return code, json.loads(out.read_text())


def test_random_workload_with_limited_concurrency(server: ServerThread, tmp_path: Path) -> None:
    plot = tmp_path / "latency.png"
    code, result = _bench(server, tmp_path, "--num-prompts", "8", "--input-len", "16", "--output-len", "6",
                          "--random-token-range", "10", "300", "--max-concurrency", "3", "--plot", str(plot))
    assert code == 0 and result["completed"] == 8 and result["failed"] == 0
    assert result["output_tokens"] == 8 * 6  # ignore_eos: every request runs to max_tokens
    assert result["config"]["model"] == "tiny"  # found through /v1/models
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        stats = result[key]
        assert 0 < stats["median"] <= stats["p90"] <= stats["p99"], key
    assert result["e2e_latency_ms"]["mean"] >= result["ttft_ms"]["mean"]
    assert result["output_token_throughput"] == pytest.approx(48 / result["duration_s"])
    assert plot.stat().st_size > 0


def test_workload_file_at_a_poisson_rate_and_chat(server: ServerThread, model_dir: Path,
                                                  tmp_path: Path) -> None:
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps({"prompts": [[5, 6, 7, 8], [9, 10, 11], [12, 13]], "n_new": 4}))
    code, result = _bench(server, tmp_path, "--workload", str(workload), "--request-rate", "20")
    assert code == 0 and result["completed"] == 3 and result["output_tokens"] == 12
    code, result = _bench(server, tmp_path, "--workload", str(workload), "--endpoint", "chat",
                          "--tokenizer", str(model_dir))
    assert code == 0 and result["completed"] == 3 and result["output_tokens"] == 12


def test_failures_are_counted(server: ServerThread, tmp_path: Path) -> None:
    code, result = _bench(server, tmp_path, "--num-prompts", "2", "--input-len", "4", "--output-len", "2",
                          "--random-token-range", "10", "300", "--model", "no-such-model", "--num-warmups", "0")
    assert code == 1 and result["failed"] == 2 and "404" in result["errors"][0]
    # With the default warm-up request, the run stops before timing anything.
    assert main(["bench", "serve", "--base-url", f"{server.base_url}/v1", "--api-key", API_KEY,
                 "--model", "no-such-model", "--num-prompts", "2"]) == 2


def test_seeded_workloads_repeat(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--num-prompts", "5", "--range-ratio", "0.5"])
    first, again = serve.load_requests(args), serve.load_requests(args)
    assert [r.prompt for r in first] == [r.prompt for r in again]
    assert len({len(r.prompt) for r in first}) > 1 and all(64 <= len(r.prompt) <= 192 for r in first)
    other_args = parser.parse_args(["--num-prompts", "5", "--range-ratio", "0.5", "--seed", "1"])
    other = serve.load_requests(other_args)
    assert [r.prompt for r in other] != [r.prompt for r in first]
