"""`kvforge bench lora`: throughput of streams spread over LoRA adapters in one engine, against the base model alone
and against each adapter merged into an engine of its own.

    lora     N streams, round-robin over the adapters (rank --lora-rank), one engine batching them together
    base     the same N streams on the base model, no adapter
    merged   each adapter's N / adapters streams in an engine of its own, one engine after another. A merged
             adapter's weights have the base's shapes and format, so each such engine runs the base model's
             step: the base engine serving N / adapters streams stands in for it (no merge is written)

Adapters are random, written by kvforge/benchmarks/lora_adapters.py from the base model's config. Every decode
bucket compiles before the clock starts (as `kvforge bench throughput` does).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from kvforge.benchmarks.lora_adapters import write_adapters
from kvforge.benchmarks.workload import random_workload
from kvforge.engine_args import add_engine_arguments, engine_kwargs_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-streams", type=int, default=16, help="concurrent requests")
    parser.add_argument("--num-adapters", type=int, default=4, help="adapters the streams are spread over")
    parser.add_argument("--lora-rank", type=int, default=16, help="rank of every adapter")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per stream")
    parser.add_argument("--output-len", type=int, default=128, help="generated tokens per stream (EOS ignored)")
    parser.add_argument("--adapters-dir", default=None, help="where the random adapters go (default: a temp dir)")
    parser.add_argument("--json", default=None, help="also write the result to this JSON file")
    add_engine_arguments(parser)


def _tokens_per_s(llm, prompts: list[list[int]], output_len: int, loras: list | None) -> float:
    from kvforge import SamplingParams

    graphs = llm.engine.runner.decode_graphs
    if graphs is not None:
        graphs.compile_ahead(len(prompts))
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def run(args: argparse.Namespace) -> int:
    from kvforge import LLM, LoRARequest

    if args.num_streams % args.num_adapters:
        raise ValueError(f"--num-streams ({args.num_streams}) must be a multiple of --num-adapters "
                         f"({args.num_adapters})")
    kwargs = engine_kwargs_from_args(args)
    num_tokens = args.output_len * args.num_streams
    result: dict[str, object] = {"num_streams": args.num_streams, "num_adapters": args.num_adapters,
                                 "lora_rank": args.lora_rank}
    with LLM(**{**kwargs, "enable_lora": False}) as llm:  # the base model, and each merged engine's stand-in
        hf_config, vocab_size = llm.engine.hf_config, llm.engine.vocab_size
        vocab_range = (min(1000, vocab_size // 2), min(40000, vocab_size))  # clear of the special tokens
        prompts = random_workload(args.num_streams, (args.input_len, args.input_len), args.output_len, seed=0,
                                  vocab_range=vocab_range).prompts
        result["base_tokens_per_s"] = _tokens_per_s(llm, prompts, args.output_len, None)
        merged_s = sum(num_tokens / args.num_adapters / _tokens_per_s(llm, prompts[a :: args.num_adapters],
                                                                      args.output_len, None)
                       for a in range(args.num_adapters))
        result["merged_tokens_per_s"] = num_tokens / merged_s
    lora_kwargs = {**kwargs, "enable_lora": True, "max_loras": max(args.num_adapters, kwargs.get("max_loras") or 1),
                   "max_lora_rank": max(args.lora_rank, kwargs.get("max_lora_rank") or 1)}
    with tempfile.TemporaryDirectory() as scratch, LLM(**lora_kwargs) as llm:
        folders = write_adapters(Path(args.adapters_dir or scratch), hf_config, args.num_adapters, args.lora_rank)
        loras = [LoRARequest(f"adapter-{i}", i + 1, str(f)) for i, f in enumerate(folders)]
        streams = [loras[i % len(loras)] for i in range(args.num_streams)]
        result["lora_tokens_per_s"] = _tokens_per_s(llm, prompts, args.output_len, streams)
        result["lora_dtype"] = str(llm.engine.runner.lora.dtype).removeprefix("torch.")  # --lora-dtype, resolved
    result["lora_vs_base"] = result["lora_tokens_per_s"] / result["base_tokens_per_s"]
    result["lora_vs_merged"] = result["lora_tokens_per_s"] / result["merged_tokens_per_s"]
    result = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
    width = max(len(k) for k in result)
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    sys.stdout.flush()
    return 0
