"""`kvforge bench startup`: how long `kvforge generate` takes to start, to answer its first token, and to finish,
run as a user runs it (a fresh process each time), a few times in a row.

Each run is two commands: `kvforge generate PROMPT --max-tokens 1` (the engine is ready when it logs its KV cache;
the first token is out when the answer is printed) and the same with --max-tokens N (the whole generation, which
runs 16 eager steps of each batch size before compiling it, in the background). The first run starts from the
on-disk caches as they are, or from an empty Inductor cache with --fresh-inductor-cache (a first run after
install, but for the C++ kernels' build); the later runs find what the earlier ones left there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

READY_LOG = "KV cache ("  # the engine's last start-up log line (LLMEngine._log_cache)


@dataclass(frozen=True, slots=True)
class GenerateTimes:
    """Seconds from starting `kvforge generate` until its engine was ready, its first output, and its exit."""

    ready_s: float
    first_output_s: float
    exit_s: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", default="Write a story about a lighthouse keeper.")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens of the whole generation")
    parser.add_argument("--runs", type=int, default=2, help="runs in a row (the second and later: warm caches)")
    parser.add_argument("--fresh-inductor-cache", action="store_true",
                        help="start from an empty Inductor cache (a temporary TORCHINDUCTOR_CACHE_DIR)")
    parser.add_argument("--json", default=None, help="also write the result to this JSON file")
    parser.add_argument("engine_args", nargs=argparse.REMAINDER,
                        help="after --: flags passed to `kvforge generate` (e.g. -- --model path.gguf)")


def time_generate(prompt: str, max_tokens: int, engine_args: list[str], env: dict[str, str]) -> GenerateTimes:
    """Run `kvforge generate` once, greedy, reading its log and output as they come."""
    command = [sys.executable, "-m", "kvforge.cli", "--log-level", "INFO", "generate", prompt, "--max-tokens",
               str(max_tokens), "--ignore-eos", "--temperature", "0", *engine_args]
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    ready: list[float] = []
    log: list[str] = []

    def read_log() -> None:
        for line in process.stderr:
            log.append(line)
            if not ready and READY_LOG in line:
                ready.append(time.perf_counter() - start)

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    first_output = process.stdout.read(1)
    first_output_s = time.perf_counter() - start
    process.stdout.read()
    returncode = process.wait()
    exit_s = time.perf_counter() - start
    reader.join()
    if returncode != 0 or not first_output or not ready:
        raise RuntimeError(f"`{' '.join(command)}` failed ({returncode}):\n{''.join(log[-20:])}")
    return GenerateTimes(ready[0], first_output_s, exit_s)


def run(args: argparse.Namespace) -> int:
    engine_args = [a for a in args.engine_args if a != "--"]
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as fresh:
        if args.fresh_inductor_cache:
            env["TORCHINDUCTOR_CACHE_DIR"] = fresh
        results = []
        for index in range(args.runs):
            first = time_generate(args.prompt, 1, engine_args, env)
            whole = time_generate(args.prompt, args.max_tokens, engine_args, env)
            results.append({"run": index + 1, "ready_s": first.ready_s, "first_token_s": first.first_output_s,
                            f"generate_{args.max_tokens}_s": whole.exit_s, "whole_ready_s": whole.ready_s})
            print(f"run {index + 1}: ready {first.ready_s:.2f} s, first token {first.first_output_s:.2f} s; "
                  f"{args.max_tokens} tokens: done in {whole.exit_s:.2f} s (ready {whole.ready_s:.2f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "kvforge generate", "prompt": args.prompt, "engine_args": engine_args,
                       "fresh_inductor_cache": args.fresh_inductor_cache, "runs": results,
                       "load": os.getloadavg()}, f, indent=2)
    return 0

