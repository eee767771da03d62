"""`kvforge plan --request-rate`: how many data-parallel replicas of which split serve a request rate within a
TTFT bound; the queueing model against the M/D/1 closed form, checked by simulation."""

from __future__ import annotations

import json
import random

import pytest

from kvforge.cli import main
from kvforge.plan.replicas import queued_ttft_ms

ARGS = ["plan", "--model", "llama-3.1-8b", "--device-type", "h100", "--prompt-tokens", "2000", "--output-tokens",
        "200", "--json"]


def _plan(capsys, *extra: str) -> dict:
    assert main([*ARGS, *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_more_traffic_needs_more_replicas_and_a_tight_bound_more_devices(capsys) -> None:
    light = _plan(capsys, "--devices", "8", "--request-rate", "10", "--ttft-ms", "500")
    heavy = _plan(capsys, "--devices", "8", "--request-rate", "100", "--ttft-ms", "500")
    assert light["recommended"]["num_devices"] < heavy["recommended"]["num_devices"]
    one_device = {(e["tp"], e["pp"]): e for e in heavy["replicas"]}[(1, 1)]
    assert one_device["num_replicas"] * one_device["capacity_rps"] > 100  # enough replicas to keep up
    assert one_device["ttft_ms"] <= 500
    tight = _plan(capsys, "--devices", "8", "--request-rate", "10", "--ttft-ms", "40")
    assert tight["recommended"]["ttft_ms"] <= 40
    assert tight["recommended"]["tp"] > 1  # one device's prefill alone is too slow for the bound


def test_cached_prefixes_need_fewer_devices(capsys) -> None:
    cold = _plan(capsys, "--devices", "8", "--request-rate", "60", "--ttft-ms", "500")
    warm = _plan(capsys, "--devices", "8", "--request-rate", "60", "--ttft-ms", "500", "--prefix-hit-rate", "0.8")
    assert warm["recommended"]["num_devices"] < cold["recommended"]["num_devices"]


def test_traffic_beyond_the_devices_is_said(capsys) -> None:
    assert main(["plan", "--model", "llama-3.1-8b", "--device-type", "h100", "--devices", "1",
                 "--request-rate", "1000"]) == 0
    assert "no split serves this traffic" in capsys.readouterr().out


def test_mean_wait_matches_a_simulated_md1_queue() -> None:
    """Poisson arrivals at one server of constant service time: the simulated mean wait is the formula's."""
    rng, service_s, rate = random.Random(0), 0.05, 14.0
    clock = free_at = total_wait = 0.0
    num = 200_000
    for _ in range(num):
        clock += rng.expovariate(rate)
        start = max(clock, free_at)
        total_wait += start - clock
        free_at = start + service_s
    simulated_ms = 1e3 * total_wait / num
    assert queued_ttft_ms(service_s, 0.0, rate) == pytest.approx(simulated_ms, rel=0.05)
    assert queued_ttft_ms(service_s, 0.0, 1 / service_s) is None  # at capacity the queue grows without bound


@pytest.mark.parametrize("argv, message", [
    (["--request-rate", "0"], "request_rate must be > 0"),
    (["--request-rate", "5", "--prefix-hit-rate", "1"], "prefix_hit_rate must be in [0, 1)"),
])
def test_bad_traffic_exits_2_with_a_message(argv, message, capsys) -> None:
    assert main(["plan", "--model", "llama-3.1-8b", *argv]) == 2
    assert message in capsys.readouterr().err
