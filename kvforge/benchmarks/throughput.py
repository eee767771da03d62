"""`kvforge bench throughput`: offline batched generation, kvforge or transformers, on one workload."""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import torch

from kvforge.benchmarks.workload import Workload, add_workload_arguments, workload_from_args
from kvforge.engine_args import add_engine_arguments, engine_kwargs_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=["kvforge", "hf"], default="kvforge",
                        help="hf: transformers' batched generate on the same workload, for comparison")
    add_workload_arguments(parser)
    parser.add_argument("--hf-batch-size", type=int, default=0, help="hf: prompts per generate call (0: all)")
    parser.add_argument("--json", default=None, help="also write the result to this JSON file")
    add_engine_arguments(parser)


def _run_kvforge(args: argparse.Namespace, workload: Workload) -> tuple[float, float]:
    """(seconds the workload took, seconds compiling the decode steps took before it)."""
    from kvforge import LLM, SamplingParams

    llm = LLM(**engine_kwargs_from_args(args))
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    # NOTE: every decode bucket the batch can use compiles before the clock starts: that is start-up cost (over a
    # minute for a batch of 64 with a cold Inductor cache), reported apart, not decode speed
    start = time.perf_counter()
    graphs = llm.engine.runner.decode_graphs
    if graphs is not None:
        graphs.compile_ahead(len(prompts))
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    if produced != workload.num_output_tokens:
        raise RuntimeError(f"generated {produced} tokens, expected {workload.num_output_tokens}")
    return elapsed, compile_s


def _run_hf(args: argparse.Namespace, workload: Workload) -> float:
    from kvforge.benchmarks.hf_reference import load_hf_model

    model = load_hf_model(args.model, args.dtype)
    batch_size = args.hf_batch_size or len(workload.prompts)
    n_new = workload.output_lens[0]
    if any(n != n_new for n in workload.output_lens):
        raise ValueError("--backend hf needs one output length for all prompts")
    start = time.perf_counter()
    for first in range(0, len(workload.prompts), batch_size):
        batch = workload.prompts[first : first + batch_size]
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                           do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def _peak_memory_mib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def run(args: argparse.Namespace) -> int:
    workload = workload_from_args(args)
    elapsed, compile_s = (_run_hf(args, workload), 0.0) if args.backend == "hf" else _run_kvforge(args, workload)
    result = {
        "backend": args.backend,
        "num_requests": len(workload.prompts),
        "prompt_tokens": workload.num_prompt_tokens,
        "output_tokens": workload.num_output_tokens,
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(len(workload.prompts) / elapsed, 3),
        "output_tokens_per_s": round(workload.num_output_tokens / elapsed, 2),
        "total_tokens_per_s": round((workload.num_output_tokens + workload.num_prompt_tokens) / elapsed, 2),
        "compile_s": round(compile_s, 1),
        "peak_memory_mib": round(_peak_memory_mib(), 1),
        "threads": torch.get_num_threads(),
    }
    width = max(len(k) for k in result)
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    sys.stdout.flush()
    return 0
