"""`kvforge bench latency`: one request at a time: time to first token and decode tokens/s.

With --compare-quantization, several weight formats of the same model are loaded side by side and the
requests alternate between them (A B C A B C ...), so that a machine whose load drifts during the run
slows every format alike; decode speed is reported against the first format.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvforge.benchmarks.workload import random_workload
from kvforge.config import CompilationConfig
from kvforge.engine_args import add_engine_arguments, engine_kwargs_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=["kvforge", "hf"], default="kvforge",
                        help="hf: transformers' generate on the same prompts, for comparison")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-requests", type=int, default=3, help="requests timed, one after another")
    parser.add_argument("--json", default=None, help="also write the result to this JSON file")
    parser.add_argument("--compare-quantization", default=None, metavar="LIST",
                        help="comma-separated weight formats timed side by side in one run, e.g. "
                             "none,w8a16,w4a16 (none: the checkpoint's own weights); overrides --quantization")
    add_engine_arguments(parser)


def _kvforge_engine(kwargs: dict):
    """An engine of these options, warmed up with one request long enough to compile the single-stream decode
    step (its bucket compiles after compile_after eager steps)."""
    from kvforge import LLM, SamplingParams

    engine = LLM(**kwargs).engine
    warmup_tokens = kwargs.get("compile_after", CompilationConfig().compile_after) + 4
    engine.add_request("warmup", {"prompt_token_ids": list(range(1, 9))},
                       SamplingParams(max_tokens=warmup_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def _time_request(engine, request_id: str, prompt: list[int], output_len: int) -> tuple[float, float]:
    """(seconds to the first token, seconds for the rest) of one request through the steppable engine."""
    from kvforge import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    first = None
    while engine.has_unfinished_requests():
        engine.step()
        first = first or time.perf_counter()
    return first - start, time.perf_counter() - first


def _time_kvforge(args: argparse.Namespace, prompts: list[list[int]]) -> list[tuple[float, float]]:
    engine = _kvforge_engine(engine_kwargs_from_args(args))
    return [_time_request(engine, str(index), prompt, args.output_len) for index, prompt in enumerate(prompts)]


def _time_formats(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, list[tuple[float, float]]]:
    """Timings per weight format, the formats taking turns request by request."""
    names = [name.strip() for name in args.compare_quantization.split(",")]
    engines = {
        name: _kvforge_engine({**engine_kwargs_from_args(args), "quantization": None if name == "none" else name})
        for name in names
    }
    timings: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for index, prompt in enumerate(prompts):
        for name, engine in engines.items():
            timings[name].append(_time_request(engine, f"{name}-{index}", prompt, args.output_len))
    return timings


def _time_hf(args: argparse.Namespace, prompts: list[list[int]]) -> list[tuple[float, float]]:
    """generate(1 token) is the time to the first token; generate(n) minus it is the decode time."""
    from kvforge.benchmarks.hf_reference import load_hf_model

    model = load_hf_model(args.model, args.dtype)
    timings = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            times = []
            for new in (1, args.output_len):
                start = time.perf_counter()
                model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
                times.append(time.perf_counter() - start)
            timings.append((times[0], times[1] - times[0]))
    return timings


def _summary(timings: list[tuple[float, float]], output_len: int) -> dict:
    return {
        "median_ttft_s": round(statistics.median(t for t, _ in timings), 4),
        "median_decode_tokens_per_s": round((output_len - 1) / statistics.median(d for _, d in timings), 2),
    }


def _run_comparison(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    formats = {name: _summary(t, args.output_len) for name, t in _time_formats(args, prompts).items()}
    baseline = next(iter(formats.values()))["median_decode_tokens_per_s"]
    print(f"{'format':<12}  {'median TTFT s':>13}  {'decode tok/s':>12}  {'vs ' + next(iter(formats)):>10}")
    for name, summary in formats.items():
        summary["decode_speedup"] = round(summary["median_decode_tokens_per_s"] / baseline, 3)
        print(f"{name:<12}  {summary['median_ttft_s']:>13}  {summary['median_decode_tokens_per_s']:>12}  "
              f"{summary['decode_speedup']:>9}x")
    return {"input_len": args.input_len, "output_len": args.output_len, "num_requests": args.num_requests,
            "threads": torch.get_num_threads(), "formats": formats}


def run(args: argparse.Namespace) -> int:
    prompts = random_workload(args.num_requests, (args.input_len, args.input_len), args.output_len, seed=0).prompts
    if args.compare_quantization:
        if args.backend != "kvforge":
            raise SystemExit("--compare-quantization times kvforge engines; drop --backend hf")
        result = _run_comparison(args, prompts)
    else:
        timings = (_time_hf if args.backend == "hf" else _time_kvforge)(args, prompts)
        result = {"backend": args.backend, "input_len": args.input_len, "output_len": args.output_len,
                  **_summary(timings, args.output_len), "threads": torch.get_num_threads()}
        for key, value in result.items():
            print(f"{key:<28}  {value}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0
