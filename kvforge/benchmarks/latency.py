"""`kvforge bench latency`: one request at a time: time to first token and decode tokens/s."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvforge.benchmarks.workload import random_workload
from kvforge.engine_args import add_engine_arguments, engine_kwargs_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=["kvforge", "hf"], default="kvforge",
                        help="hf: transformers' generate on the same prompts, for comparison")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-requests", type=int, default=3, help="requests timed, one after another")
    parser.add_argument("--json", default=None, help="also write the result to this JSON file")
    add_engine_arguments(parser)


def _time_kvforge(args: argparse.Namespace, prompts: list[list[int]]) -> list[tuple[float, float]]:
    """(seconds to the first token, seconds for the rest) per request, through the steppable engine."""
    from kvforge import LLM, SamplingParams

    engine = LLM(**engine_kwargs_from_args(args)).engine
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    engine.add_request("warmup", {"prompt_token_ids": prompts[0][:8]}, SamplingParams(max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    timings = []
    for index, prompt in enumerate(prompts):
        start = time.perf_counter()
        engine.add_request(str(index), {"prompt_token_ids": prompt}, params)
        first = None
        while engine.has_unfinished_requests():
            engine.step()
            first = first or time.perf_counter()
        timings.append((first - start, time.perf_counter() - first))
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


def run(args: argparse.Namespace) -> int:
    prompts = random_workload(args.num_requests, (args.input_len, args.input_len), args.output_len, seed=0).prompts
    timings = (_time_hf if args.backend == "hf" else _time_kvforge)(args, prompts)
    ttft = statistics.median(t for t, _ in timings)
    decode = statistics.median(d for _, d in timings)
    result = {
        "backend": args.backend,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "median_ttft_s": round(ttft, 4),
        "median_decode_tokens_per_s": round((args.output_len - 1) / decode, 2),
        "threads": torch.get_num_threads(),
    }
    for key, value in result.items():
        print(f"{key:<28}  {value}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0
