"""`kvforge bench startup`: time to first token and to the end of a generation of `kvforge generate`, run as a user
runs it (a fresh process each time): cold, as the first run after an install (empty torch extensions and Inductor
caches), then warm (the runs after it, which find what the first left there); beside llama.cpp on the same GGUF file.

`kvforge generate` prints its answer when the generation ends: its first token is timed by a run of --max-tokens 1,
its whole generation by a run of --max-tokens N, each with caches of its own, so that both have a cold run. It is
ready (loaded, KV cache allocated) when it logs its KV cache. llama.cpp's completion tool prints each token as it
comes: one run times both; it has no caches to warm but the file's pages, which the kvforge runs have read first.
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
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

READY_LOG = "KV cache ("  # the engine's last start-up log line (LLMEngine._log_cache)
# NOTE: llama-completion is llama.cpp's plain completion tool (called llama-cli before llama.cpp gave that name to its
# chat tool, which takes no raw prompt). llama-simple has no flag for its threads (4) nor to go on past end-of-text.
LLAMA_CPP_TOOLS = ("llama-completion", "llama-cli")


@dataclass(frozen=True, slots=True)
class ProcessTimes:
    """Seconds from starting a command until its log said ready (None: no such line), its first output, its exit."""

    ready_s: float | None
    first_output_s: float
    exit_s: float


@dataclass(frozen=True, slots=True)
class StartupRow:
    """One line of the table: a runner's run, cold or warm."""

    runner: str
    run: str
    ready_s: float | None
    first_token_s: float
    whole_s: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="the model, a .gguf file to compare with llama.cpp (default: the default model's file)")
    parser.add_argument("--prompt", default="Write a story about a lighthouse keeper.")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens of the whole generation")
    parser.add_argument("--warm-runs", type=int, default=1, help="runs after the cold one")
    parser.add_argument("--llama-cpp", default=None, metavar="PATH",
                        help="also time llama.cpp: its llama-completion binary, or a folder holding it (or llama-cli, "
                             "as llama.cpp named it before)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="llama.cpp's threads (default: the cores this process may use, as torch takes)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    parser.add_argument("engine_args", nargs=argparse.REMAINDER,
                        help="after --: more flags for `kvforge generate` (e.g. -- --kv-cache-memory 64MiB)")


def time_process(command: list[str], env: dict[str, str] | None = None, ready_log: str | None = None) -> ProcessTimes:
    """Run command to its end, reading its output and log as they come."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    ready: list[float] = []
    log: list[bytes] = []

    def read_log() -> None:
        for line in process.stderr:
            log.append(line)
            if ready_log is not None and not ready and ready_log.encode() in line:
                ready.append(time.perf_counter() - start)

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    first_output = process.stdout.read(1)
    first_output_s = time.perf_counter() - start
    process.stdout.read()
    returncode = process.wait()
    exit_s = time.perf_counter() - start
    reader.join()
    if returncode != 0 or not first_output or (ready_log is not None and not ready):
        tail = b"".join(log[-20:]).decode(errors="replace")
        raise RuntimeError(f"`{' '.join(command)}` failed (exit code {returncode}):\n{tail}")
    return ProcessTimes(ready[0] if ready else None, first_output_s, exit_s)


def _cold_then_warm(num_warm: int, run: Callable[[dict[str, str]], ProcessTimes]) -> list[ProcessTimes]:
    """run in caches of its own: first empty (cold), then num_warm times more in what it left there."""
    with tempfile.TemporaryDirectory(prefix="kvforge-startup-") as caches:
        env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(Path(caches, "torch_extensions")),
               "TORCHINDUCTOR_CACHE_DIR": str(Path(caches, "inductor"))}
        return [run(env) for _ in range(1 + num_warm)]


def kvforge_rows(model: str, prompt: str, max_tokens: int, num_warm: int, engine_args: list[str]) -> list[StartupRow]:
    """`kvforge generate`, greedy: cold and warm runs of --max-tokens 1, then of --max-tokens max_tokens."""

    def generate(tokens: int) -> Callable[[dict[str, str]], ProcessTimes]:
        command = [sys.executable, "-m", "kvforge.cli", "--log-level", "INFO", "generate", prompt, "--model", model,
                   "--max-tokens", str(tokens), "--ignore-eos", "--temperature", "0", *engine_args]
        return lambda env: time_process(command, env, READY_LOG)

    first = _cold_then_warm(num_warm, generate(1))
    whole = _cold_then_warm(num_warm, generate(max_tokens))
    return [StartupRow("kvforge generate", _run_name(index), f.ready_s, f.exit_s, w.exit_s)
            for index, (f, w) in enumerate(zip(first, whole))]


def llama_cpp_rows(tool: str, model: str, prompt: str, max_tokens: int, num_warm: int, threads: int
                   ) -> list[StartupRow]:
    """llama.cpp's completion tool, greedy, without its prompt echo: first output and exit of each run."""
    command = [tool, "-m", model, "-p", prompt, "-n", str(max_tokens), "-t", str(threads), "--temp", "0",
               "--ignore-eos", "-no-cnv", "--no-display-prompt"]
    rows = []
    for index in range(1 + num_warm):
        times = time_process(command)
        rows.append(StartupRow(f"llama.cpp {Path(tool).name}", _run_name(index), None, times.first_output_s,
                               times.exit_s))
    return rows


def llama_cpp_tool(path: str) -> str:
    """The llama.cpp completion binary at path, or in the folder path names."""
    folder = Path(path)
    if folder.is_dir():
        found = [folder / name for name in LLAMA_CPP_TOOLS if (folder / name).is_file()]
        if not found:
            raise ValueError(f"--llama-cpp: {path} holds none of {', '.join(LLAMA_CPP_TOOLS)} (build one with "
                             "`cmake --build BUILD --target llama-completion` in llama.cpp's source tree)")
        return str(found[0])
    if not folder.is_file() or folder.name not in LLAMA_CPP_TOOLS:
        raise ValueError(f"--llama-cpp: {path} is not a folder nor one of {', '.join(LLAMA_CPP_TOOLS)}")
    return str(folder)


def _run_name(index: int) -> str:
    return "cold" if index == 0 else f"warm {index}" if index > 1 else "warm"


def format_table(rows: list[StartupRow], max_tokens: int) -> str:
    lines = [f"| runner | run | ready (s) | first token (s) | {max_tokens} tokens, to exit (s) |",
             "|---|---|---:|---:|---:|"]
    for row in rows:
        ready = "-" if row.ready_s is None else f"{row.ready_s:.2f}"
        lines.append(f"| {row.runner} | {row.run} | {ready} | {row.first_token_s:.2f} | {row.whole_s:.2f} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from kvforge.loader.default_model import default_model_path

    if args.max_tokens < 1 or args.warm_runs < 0 or args.threads < 1:
        raise ValueError(f"--max-tokens and --threads must be >= 1 and --warm-runs >= 0, got {args.max_tokens}, "
                         f"{args.threads} and {args.warm_runs}")
    model = args.model or default_model_path()
    tool = None if args.llama_cpp is None else llama_cpp_tool(args.llama_cpp)
    if tool is not None and not model.endswith(".gguf"):
        raise ValueError(f"--llama-cpp runs GGUF files only, got --model {model}")
    engine_args = [a for a in args.engine_args if a != "--"]
    load = os.getloadavg()
    rows = kvforge_rows(model, args.prompt, args.max_tokens, args.warm_runs, engine_args)
    if tool is not None:
        rows += llama_cpp_rows(tool, model, args.prompt, args.max_tokens, args.warm_runs, args.threads)
    print(format_table(rows, args.max_tokens))
    print(f"model {model}; load average at the start {load[0]:.1f}, at the end {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model, "prompt": args.prompt, "max_tokens": args.max_tokens,
                       "engine_args": engine_args, "llama_cpp": tool, "threads": args.threads,
                       "load_average": [load[0], os.getloadavg()[0]], "rows": [asdict(r) for r in rows]}, f, indent=2)
    return 0
