"""`kvforge bench router`: replicas behind the router against one replica, on a chat service's shape of traffic:
a few long system prompts shared by many requests. Each setup is started as the user starts it (`kvforge serve`,
with `--data-parallel-size N --policy P`), driven by `kvforge bench serve`'s client, and reports throughput, TTFT
and the prefix-cache hit rate (prompt tokens found in the replicas' caches / prompt tokens looked up).

    kvforge bench router --replicas 2 --num-prompts 256 --num-systems 16 --out router.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvforge.benchmarks import serve as serve_bench
from kvforge.benchmarks.serve import BenchRequest

_TEXTS = Path(__file__).parents[1] / "data" / "calibration"


def shared_prefix_requests(num_prompts: int, num_systems: int, system_chars: int, question_chars: int,
                           max_tokens: int, seed: int) -> list[BenchRequest]:
    """`num_prompts` requests, each one of `num_systems` system prompts (slices of the calibration texts) and a
    question of its own, in a seeded random order."""
    rng = random.Random(seed)
    corpus = " ".join(" ".join((_TEXTS / name).read_text().split()) for name in ("prose.txt", "technical.txt"))

    def passage(length: int) -> str:
        start = rng.randrange(len(corpus) - length)
        return corpus[start:start + length]

    systems = [f"You are assistant {i}. Answer from this reference only.\n\n{passage(system_chars)}\n\n"
               for i in range(num_systems)]
    return [BenchRequest(f"{rng.choice(systems)}Question: {passage(question_chars)}\nAnswer:", max_tokens)
            for _ in range(num_prompts)]


def _metric_sum(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def prefix_cache_counts(http: httpx.Client, replicas: int) -> tuple[float, float]:
    """(prompt tokens looked up, found) over the replicas, from the router's /metrics or the lone server's."""
    text = http.get("/metrics").text
    if replicas == 1:
        return (_metric_sum(text, "kvforge:prefix_cache_queries_total"),
                _metric_sum(text, "kvforge:prefix_cache_hits_total"))
    return (_metric_sum(text, "kvforge_router:replica_prefix_cache_queries{"),
            _metric_sum(text, "kvforge_router:replica_prefix_cache_hits{"))


def _start(args: argparse.Namespace, replicas: int, policy: str, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "kvforge.cli", "--log-level", "WARNING", "serve", "--port", str(port),
               "--uvicorn-log-level", "warning", *shlex.split(args.serve_args)]
    if replicas > 1:
        command += ["--data-parallel-size", str(replicas), "--policy", policy, "--health-interval", "0.5"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL)


def _wait_ready(http: httpx.Client, server: subprocess.Popen, replicas: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if server.poll() is not None:
            raise ValueError(f"the server exited with code {server.returncode} (see its log above)")
        try:
            answer = http.get("/health")
            if answer.status_code == 200 and answer.json().get("healthy_replicas", 1) == replicas:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise ValueError(f"the server was not healthy within {timeout:g} s")
        time.sleep(1.0)


def run_setup(args: argparse.Namespace, replicas: int, policy: str, requests: list[BenchRequest]) -> dict:
    """Start the setup, drive it with the requests, stop it; its summary with the prefix-cache hit rate."""
    port = args.port
    server = _start(args, replicas, policy, port)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    try:
        _wait_ready(http, server, replicas, args.start_timeout)
        client_args = _client_args(args, port)
        queries_before, hits_before = prefix_cache_counts(http, replicas)
        results, duration = asyncio.run(serve_bench.run_requests(client_args, requests))
        time.sleep(1.5)  # the router reads the replicas' counters every --health-interval
        queries, hits = prefix_cache_counts(http, replicas)
    finally:
        http.close()
        server.terminate()
        server.wait(timeout=120)
    summary = serve_bench.summarize(results, duration)
    summary["prefix_cache_hit_rate"] = (hits - hits_before) / max(queries - queries_before, 1.0)
    summary["setup"] = {"replicas": replicas, "policy": policy if replicas > 1 else "-", "cores": os.cpu_count()}
    return summary


def _client_args(args: argparse.Namespace, port: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_bench.add_arguments(parser)
    client = parser.parse_args(["--base-url", f"http://127.0.0.1:{port}/v1", "--max-concurrency",
                                str(args.max_concurrency), "--seed", str(args.seed), "--num-warmups", "1"])
    client.ignore_eos = True
    return client


def format_results(summaries: list[dict]) -> str:
    header = ("setup", "req/s", "output tok/s", "per core tok/s", "TTFT mean ms", "TTFT p50 ms", "TTFT p99 ms",
              "prefix hit rate", "failed")
    rows = []
    for s in summaries:
        setup = s["setup"]
        name = "1 replica" if setup["replicas"] == 1 else f"{setup['replicas']} replicas, {setup['policy']}"
        ttft = s["ttft_ms"]
        rows.append((name, f"{s['request_throughput']:.2f}", f"{s['output_token_throughput']:.1f}",
                     f"{s['output_token_throughput'] / setup['cores']:.1f}", f"{ttft['mean']:.0f}",
                     f"{ttft['median']:.0f}", f"{ttft['p99']:.0f}", f"{s['prefix_cache_hit_rate']:.1%}",
                     str(s["failed"])))
    widths = [max(len(header[i]), *(len(row[i]) for row in rows)) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=2, help="replicas behind the router (against one alone)")
    parser.add_argument("--policies", nargs="+", default=["prefix", "round-robin"],
                        choices=["prefix", "round-robin"], help="routing policies to run")
    parser.add_argument("--num-prompts", type=int, default=256, help="requests")
    parser.add_argument("--num-systems", type=int, default=16, help="system prompts the requests share")
    parser.add_argument("--system-chars", type=int, default=2000, help="characters of each system prompt")
    parser.add_argument("--question-chars", type=int, default=200, help="characters of each request's own part")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (ignore_eos)")
    parser.add_argument("--max-concurrency", type=int, default=32, help="most requests in flight")
    parser.add_argument("--seed", type=int, default=0, help="seeds the workload and the client")
    parser.add_argument("--port", type=int, default=8123, help="port of the server under test")
    parser.add_argument("--serve-args", default="--kv-cache-memory 512MiB",
                        help="flags for every `kvforge serve` (model, cache size, ...), as one string")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds a setup may take to start")
    parser.add_argument("--out", default=None, help="write every setup's summary as JSON")


def run(args: argparse.Namespace) -> int:
    for name in ("replicas", "num_prompts", "num_systems", "system_chars", "question_chars", "max_tokens",
                 "max_concurrency"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    requests = shared_prefix_requests(args.num_prompts, args.num_systems, args.system_chars, args.question_chars,
                                      args.max_tokens, args.seed)
    setups = [(1, "-")] + [(args.replicas, policy) for policy in args.policies]
    summaries = []
    for replicas, policy in setups:
        summaries.append(run_setup(args, replicas, policy, requests))
        print(format_results(summaries[-1:]), flush=True)
    print()
    print(format_results(summaries))
    if args.out:
        Path(args.out).write_text(json.dumps(summaries, indent=1, default=float))
    return 0 if all(s["failed"] == 0 for s in summaries) else 1
