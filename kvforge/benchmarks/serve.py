"""`kvforge bench serve`: drive any OpenAI-compatible server with a seeded workload, streaming, and
report request and token throughput with TTFT, TPOT, ITL and end-to-end latency percentiles.

Workloads: random token-id prompts (--input-len, --output-len), a JSONL of prompts (--dataset), or
a token-id workload file (--workload, e.g. /work/shared/workloads/w64.json). Requests are sent at a
Poisson --request-rate (seeded) and/or with at most --max-concurrency in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from kvforge.tokenizer import Tokenizer

_PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class BenchRequest:
    prompt: str | list[int]
    max_tokens: int


@dataclass(slots=True)
class RequestResult:
    """What one streamed request measured; times in seconds from the benchmark's start."""

    start: float
    ok: bool = False
    error: str = ""
    ttft: float = 0.0  # to the first chunk with a choice (as vLLM's benchmark counts)
    latency: float = 0.0  # to the end of the stream
    num_output_tokens: int = 0
    itls: list[float] = field(default_factory=list)  # gaps between chunks with a choice

    @property
    def tpot(self) -> float | None:
        if self.num_output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.num_output_tokens - 1)


# ---- workloads --------------------------------------------------------------------------------
def _load_tokenizer(path: str) -> Tokenizer:
    if Path(path).is_file():
        from kvforge.loader.gguf_file import GGUFFile

        return Tokenizer.from_gguf(GGUFFile(path).metadata)
    return Tokenizer.from_dir(path)


def _random_requests(args: argparse.Namespace, rng: random.Random) -> list[BenchRequest]:
    def length(mean: int) -> int:
        low, high = int(mean * (1 - args.range_ratio)), int(mean * (1 + args.range_ratio))
        return rng.randint(max(1, low), max(1, high))

    low, high = args.random_token_range
    requests = []
    for _ in range(args.num_prompts):
        prompt = [rng.randrange(low, high) for _ in range(length(args.input_len))]
        requests.append(BenchRequest(prompt, length(args.output_len)))
    return requests


def _dataset_requests(path: str, args: argparse.Namespace, rng: random.Random) -> list[BenchRequest]:
    requests = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"{path}:{number}: each line must be a JSON object with a string 'prompt'")
        requests.append(BenchRequest(row["prompt"], int(row.get("max_tokens", args.output_len))))
    if not requests:
        raise ValueError(f"{path} holds no prompts")
    rng.shuffle(requests)
    return requests[: args.num_prompts] if args.num_prompts else requests


def _workload_requests(path: str) -> list[BenchRequest]:
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "prompts" not in data or "n_new" not in data:
        raise ValueError(f"{path}: a workload is {{'prompts': [[token ids], ...], 'n_new': N}}")
    return [BenchRequest(list(prompt), int(data["n_new"])) for prompt in data["prompts"]]


def load_requests(args: argparse.Namespace) -> list[BenchRequest]:
    """The workload's requests, with token-id prompts decoded to text where the endpoint needs it."""
    rng = random.Random(args.seed)
    if args.workload:
        requests = _workload_requests(args.workload)
    elif args.dataset:
        requests = _dataset_requests(args.dataset, args, rng)
    else:
        requests = _random_requests(args, rng)
    if args.max_tokens is not None:
        requests = [BenchRequest(r.prompt, args.max_tokens) for r in requests]
    needs_text = args.endpoint == "chat" or args.prompt_as == "text"
    if needs_text and any(not isinstance(r.prompt, str) for r in requests):
        if not args.tokenizer:
            raise ValueError("token-id prompts must be decoded to text for this endpoint: pass --tokenizer "
                             "(a .gguf file or Hugging Face folder)")
        tokenizer = _load_tokenizer(args.tokenizer)
        requests = [BenchRequest(r.prompt if isinstance(r.prompt, str) else tokenizer.decode(r.prompt),
                                 r.max_tokens) for r in requests]
    return requests


# ---- sending ----------------------------------------------------------------------------------
def _payload(args: argparse.Namespace, request: BenchRequest) -> dict:
    payload = {"model": args.model, "max_tokens": request.max_tokens, "temperature": args.temperature,
               "stream": True, "stream_options": {"include_usage": True}}
    if args.ignore_eos:  # vLLM's ignore_eos; min_tokens too, for servers that only know that
        payload.update(ignore_eos=True, min_tokens=request.max_tokens)
    if args.endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        payload["prompt"] = request.prompt
    return payload




def _choice_text(choice: dict) -> str:
    delta = choice.get("delta")
    return (delta.get("content") or "") if isinstance(delta, dict) else (choice.get("text") or "")


async def send_request(http: httpx.AsyncClient, args: argparse.Namespace, request: BenchRequest,
                       t0: float) -> RequestResult:
    """Stream one request. Its output tokens are the server's usage count; for servers that report
    none in a stream, max_tokens when it finished for length, else the chunks that carried text."""
    path = "/chat/completions" if args.endpoint == "chat" else "/completions"
    result = RequestResult(start=time.perf_counter() - t0)
    started, last, num_text_chunks, usage_tokens, finish_reason = time.perf_counter(), None, 0, None, None
    try:
        async with http.stream("POST", path, json=_payload(args, request)) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    result.error = str(event["error"])
                    return result
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                choices = event.get("choices")
                if choices:  # NOTE: a token's text may be empty (held back, special)
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - started
                    else:
                        result.itls.append(now - last)
                    last = now
                    num_text_chunks += any(_choice_text(c) for c in choices)
                    finish_reason = choices[0].get("finish_reason") or finish_reason
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.latency = time.perf_counter() - started
    if usage_tokens is not None:
        result.num_output_tokens = usage_tokens
    else:
        result.num_output_tokens = request.max_tokens if finish_reason == "length" else num_text_chunks
    result.ok = last is not None
    result.error = "" if result.ok else "no choice in the stream"
    return result


async def run_requests(args: argparse.Namespace,
                       requests: list[BenchRequest]) -> tuple[list[RequestResult], float]:
    """Send every request (Poisson arrivals at --request-rate, at most --max-concurrency in flight)."""
    rng = random.Random(args.seed + 1)
    limit = asyncio.Semaphore(args.max_concurrency or len(requests))
    headers = {"Authorization": f"Bearer {args.api_key}"}
    connections = httpx.Limits(max_connections=(args.max_concurrency or len(requests)) + 4)
    async with httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers, limits=connections,
                                 timeout=httpx.Timeout(args.timeout)) as http:
        if args.model is None:
            args.model = (await http.get("/models")).raise_for_status().json()["data"][0]["id"]
        # Untimed: lets the server compile kernels. The prompt is reversed so no prefix cache hit helps later.
        for _ in range(args.num_warmups):
            warmup = await send_request(http, args, BenchRequest(requests[0].prompt[::-1], 4), time.perf_counter())
            if not warmup.ok:
                raise ValueError(f"the warm-up request failed: {warmup.error}")

        async def one(request: BenchRequest) -> RequestResult:
            async with limit:
                return await send_request(http, args, request, t0)

        t0 = time.perf_counter()
        tasks = []
        for request in requests:
            tasks.append(asyncio.ensure_future(one(request)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


# ---- reporting --------------------------------------------------------------------------------
def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "median": math.nan, **{f"p{p}": math.nan for p in _PERCENTILES if p != 50}}
    array = np.asarray(values) * 1000.0  # milliseconds
    stats = {"mean": float(array.mean()), "median": float(np.median(array))}
    stats.update({f"p{p}": float(np.percentile(array, p)) for p in _PERCENTILES if p != 50})
    return stats


def summarize(results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.ok]
    num_output = sum(r.num_output_tokens for r in done)
    return {
        "num_requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "output_tokens": num_output,
        "request_throughput": len(done) / duration,
        "output_token_throughput": num_output / duration,
        "ttft_ms": _stats([r.ttft for r in done]),
        "tpot_ms": _stats([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": _stats([gap for r in done for gap in r.itls]),
        "e2e_latency_ms": _stats([r.latency for r in done]),
    }


def format_table(summary: dict, title: str) -> str:
    rows = [
        ("completed / failed", f"{summary['completed']} / {summary['failed']}"),
        ("duration (s)", f"{summary['duration_s']:.2f}"),
        ("output tokens", f"{summary['output_tokens']}"),
        ("request throughput (req/s)", f"{summary['request_throughput']:.3f}"),
        ("output token throughput (tok/s)", f"{summary['output_token_throughput']:.1f}"),
    ]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_latency_ms", "E2E")):
        stats = summary[key]
        rows.append((f"{name} mean / median / p90 / p99 (ms)",
                     " / ".join(f"{stats[k]:.1f}" for k in ("mean", "median", "p90", "p99"))))
    width = max(len(name) for name, _ in rows)
    lines = [f"==== {title} ====", *(f"{name:<{width}}  {value}" for name, value in rows)]
    lines += [f"error: {error}" for error in summary["errors"]]
    return "\n".join(lines)


def plot(results: list[RequestResult], title: str, path: str) -> None:
    """CDFs of TTFT, TPOT, ITL and end-to-end latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if r.ok]
    series = {
        "TTFT (s)": [r.ttft for r in done],
        "TPOT (ms)": [t * 1000 for r in done if (t := r.tpot) is not None],
        "ITL (ms)": [gap * 1000 for r in done for gap in r.itls],
        "end-to-end latency (s)": [r.latency for r in done],
    }
    figure, axes = plt.subplots(2, 2, figsize=(10, 7))
    for axis, (name, values) in zip(axes.flat, series.items(), strict=True):
        values = np.sort(values)
        axis.plot(values, np.arange(1, len(values) + 1) / max(len(values), 1))
        axis.set_xlabel(name)
        axis.set_ylabel("fraction of requests" if "ITL" not in name else "fraction of gaps")
        axis.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# ---- command line -----------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    parser.add_argument("--model", default=None, help="model name to send (default: the first of /models)")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--api-key", default="none", help="sent as 'Authorization: Bearer KEY'")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--workload",
                        help="JSON {'prompts': [[token ids]...], 'n_new': N}, sent with ignore_eos")
    source.add_argument("--dataset", help="JSONL of {'prompt': text, 'max_tokens'?: N}")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests (random or dataset workloads)")
    parser.add_argument("--input-len", type=int, default=128, help="mean prompt tokens (random workload)")
    parser.add_argument("--output-len", type=int, default=128, help="mean output tokens (random, dataset)")
    parser.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in mean x [1-r, 1+r]")
    parser.add_argument("--random-token-range", type=int, nargs=2, default=[1000, 40000],
                        metavar=("LOW", "HIGH"),
                        help="random prompt token ids are drawn from [LOW, HIGH)")
    parser.add_argument("--max-tokens", type=int, default=None, help="override every request's output length")
    parser.add_argument("--prompt-as", choices=["ids", "text"], default="ids",
                        help="send token-id prompts as ids or decoded text (chat always sends text)")
    parser.add_argument("--tokenizer", default=None,
                        help=".gguf file or HF folder to decode token-id prompts")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                        help="generate exactly max_tokens (default: on for --workload and random prompts)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument("--seed", type=int, default=0, help="seeds prompts and arrival times")
    parser.add_argument("--num-warmups", type=int, default=1, help="untimed short requests sent first")
    parser.add_argument("--timeout", type=float, default=3600.0, help="per-request timeout in seconds")
    parser.add_argument("--label", default=None, help="name of this run in the table and JSON")
    parser.add_argument("--out", default=None, help="write the summary and per-request results as JSON")
    parser.add_argument("--plot", default=None, help="write latency CDFs to this image file")


def run(args: argparse.Namespace) -> int:
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.ignore_eos is None:
        args.ignore_eos = not args.dataset
    requests = load_requests(args)
    results, duration = asyncio.run(run_requests(args, requests))
    summary = summarize(results, duration)
    title = args.label or f"{args.model} at {args.base_url}"
    summary["config"] = {"label": title, "base_url": args.base_url, "model": args.model,
                         "endpoint": args.endpoint,
                         "num_requests": len(requests), "request_rate": args.request_rate,
                         "max_concurrency": args.max_concurrency, "seed": args.seed,
                         "workload": args.workload or args.dataset or "random", "prompt_as": args.prompt_as}
    print(format_table(summary, title))
    if args.out:
        report = {**summary, "requests": [asdict(r) for r in results]}
        Path(args.out).write_text(json.dumps(report, indent=1, default=float))
    if args.plot:
        plot(results, title, args.plot)
    return 0 if summary["failed"] == 0 else 1
