"""`kvforge bench latency`: one request at a time: time to first token, decode tokens/s, and the host time
of a decode step outside the executor (kvforge only).

With --compare-quantization, several weight formats of the same model are loaded side by side and the
requests alternate between them (A B C A B C ...), so that a machine whose load drifts during the run
slows every format alike; decode speed is reported against the first format.
"""

from __future__ import annotations

import argparse
import json
import resource
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
    parser.add_argument("--compare-quantization", default=None, metavar="LIST",
                        help="comma-separated weight formats timed side by side in one run, e.g. "
                             "none,w8a16,w4a16 (none: the checkpoint's own weights); overrides --quantization")
    add_engine_arguments(parser)


def _kvforge_engine(kwargs: dict):
    """An engine of these options with its single-stream decode step compiled and warmed up by one short request,
    and the seconds its load took (LLM(...))."""
    from kvforge import LLM, SamplingParams

    start = time.perf_counter()
    engine = LLM(**kwargs).engine
    load_s = time.perf_counter() - start
    if engine.runner.decode_graphs is not None:
        engine.runner.decode_graphs.compile_ahead(1)
    engine.add_request("warmup", {"prompt_token_ids": list(range(1, 9))},
                       SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return engine, load_s


class _ExecutorClock:
    """Seconds the engine spends in its executor (the model runner: batch, model, sampling), read by
    wrapping the engine's executor.submit for this benchmark only; a step's remainder is host time
    (scheduling, the update after the step, detokenizing, outputs)."""

    def __init__(self, engine) -> None:
        self.seconds = 0.0
        submit = engine.executor.submit

        def timed_submit(output) -> None:
            start = time.perf_counter()
            submit(output)
            self.seconds += time.perf_counter() - start

        engine.executor.submit = timed_submit


def _time_request(engine, clock: _ExecutorClock, request_id: str, prompt: list[int], output_len: int
                  ) -> tuple[float, float, float]:
    """(seconds to the first token, seconds for the rest, host seconds per decode step outside the
    executor) of one request through the steppable engine."""
    from kvforge import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    engine.step()
    first, in_executor, num_steps = time.perf_counter(), clock.seconds, 0
    while engine.has_unfinished_requests():
        engine.step()
        num_steps += 1
    decode = time.perf_counter() - first
    return first - start, decode, (decode - (clock.seconds - in_executor)) / max(num_steps, 1)


def _time_kvforge(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[list[tuple[float, ...]], dict]:
    engine, load_s = _kvforge_engine(engine_kwargs_from_args(args))
    clock = _ExecutorClock(engine)
    timings = [_time_request(engine, clock, str(index), prompt, args.output_len)
               for index, prompt in enumerate(prompts)]
    model = engine.local_model  # NOTE: the bytes a decode step reads: its weights, not the rope tables
    tensors = [*model.parameters(), *(b for name, b in model.named_buffers() if not name.endswith("cos_sin_cache"))]
    return timings, {"load_s": round(load_s, 2), "weight_mib": round(sum(t.nbytes for t in tensors) / 2**20, 1)}


def _time_formats(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, list[tuple[float, ...]]]:
    """Timings per weight format, the formats taking turns request by request."""
    names = [name.strip() for name in args.compare_quantization.split(",")]
    engines = {name: _kvforge_engine({**engine_kwargs_from_args(args), "quantization": name})[0] for name in names}
    clocks = {name: _ExecutorClock(engine) for name, engine in engines.items()}
    timings: dict[str, list[tuple[float, ...]]] = {name: [] for name in names}
    for index, prompt in enumerate(prompts):
        for name, engine in engines.items():
            timings[name].append(_time_request(engine, clocks[name], f"{name}-{index}", prompt, args.output_len))
    return timings


def _time_hf(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[list[tuple[float, ...]], dict]:
    """generate(1 token) is the time to the first token; generate(n) minus it is the decode time."""
    from kvforge.benchmarks.hf_reference import load_hf_model

    start = time.perf_counter()
    model = load_hf_model(args.model, args.dtype)
    load_s = time.perf_counter() - start
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
    return timings, {"load_s": round(load_s, 2)}


def _summary(timings: list[tuple[float, ...]], output_len: int) -> dict:
    """Medians over the requests; kvforge's timings also say the host time per decode step."""
    summary = {
        "median_ttft_s": round(statistics.median(t[0] for t in timings), 4),
        "median_decode_tokens_per_s": round((output_len - 1) / statistics.median(t[1] for t in timings), 2),
    }
    if len(timings[0]) > 2:
        summary["median_host_ms_per_decode_step"] = round(1000 * statistics.median(t[2] for t in timings), 3)
    return summary


def _run_comparison(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    formats = {name: _summary(t, args.output_len) for name, t in _time_formats(args, prompts).items()}
    baseline = next(iter(formats.values()))["median_decode_tokens_per_s"]
    print(f"{'format':<12}  {'median TTFT s':>13}  {'decode tok/s':>12}  {'host ms/step':>12}  "
          f"{'vs ' + next(iter(formats)):>10}")
    for name, summary in formats.items():
        summary["decode_speedup"] = round(summary["median_decode_tokens_per_s"] / baseline, 3)
        print(f"{name:<12}  {summary['median_ttft_s']:>13}  {summary['median_decode_tokens_per_s']:>12}  "
              f"{summary['median_host_ms_per_decode_step']:>12}  {summary['decode_speedup']:>9}x")
    return {"input_len": args.input_len, "output_len": args.output_len, "num_requests": args.num_requests,
            "threads": torch.get_num_threads(), "formats": formats}


def run(args: argparse.Namespace) -> int:
    prompts = random_workload(args.num_requests, (args.input_len, args.input_len), args.output_len, seed=0).prompts
    if args.compare_quantization:
        if args.backend != "kvforge":
            raise SystemExit("--compare-quantization times kvforge engines; drop --backend hf")
        result = _run_comparison(args, prompts)
    else:
        timings, load = (_time_hf if args.backend == "hf" else _time_kvforge)(args, prompts)
        # NOTE: ru_maxrss is the process's peak resident memory (KiB on Linux): the load's peak or the run's
        result = {"backend": args.backend, "input_len": args.input_len, "output_len": args.output_len,
                  **_summary(timings, args.output_len), **load, "threads": torch.get_num_threads(),
                  "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}
        for key, value in result.items():
            print(f"{key:<32}  {value}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0
