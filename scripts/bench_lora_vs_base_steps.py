"""Multi-LoRA against the base model, step by step, in one process: a base engine and a LoRA engine per adapter dtype
(--lora-dtypes; 4 adapters of rank 16, 16 streams round robin over them) on the default model, decode steps of 16 rows
timed in alternation (base, LoRA float32, LoRA bfloat16, base, ...), then prompt steps in alternation. Each round's
ratio is LoRA speed / base speed; the median is printed per LoRA engine. For a shared, noisy machine, where
`kvforge bench lora` (one engine after the other) cannot be trusted:

    python scripts/bench_lora_vs_base_steps.py --rounds 8 --steps 3 --prompt-rounds 3 --prompt-len 64 [--eager] \
        [--lora-dtypes float32,bfloat16]

--profile N: then N decode steps of each engine under torch.profiler, and per engine its ops' self time per step
(share of the step). The compiled graph's own self time is its fused kernels (norms, rotary, activations, residual
adds) and its wrapper, which the profiler does not see one by one; the rest is the engine's Python around the graph.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch.profiler

from kvforge import LLM, LoRARequest, SamplingParams
from kvforge.benchmarks.lora_adapters import write_adapters
from kvforge.benchmarks.workload import random_workload

NUM_STREAMS, NUM_ADAPTERS, RANK = 16, 4, 16


def _add(llm: LLM, prompts: list[list[int]], loras: list, max_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for prompt, lora in zip(prompts, loras):
        llm.engine.add_request(None, {"prompt_token_ids": prompt}, params, lora)


def _decoding(llm: LLM, prompts: list[list[int]], loras: list) -> None:
    """The streams added and prefilled: every later step is a decode step of all of them."""
    _add(llm, prompts, loras, 1 << 20)
    generated: dict[str, int] = {}
    while len(generated) < len(prompts) or min(generated.values()) < 2:
        for output in llm.engine.step():
            generated[output.request_id] = len(output.outputs[0].token_ids)


def _profile(engines: dict[str, LLM], steps: int, top: int = 8) -> None:
    """Each engine's decode steps under the profiler: the ops of most self time, per step and as a share of it."""
    for name, llm in engines.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                llm.engine.step()
            step_ms = (time.perf_counter() - start) / steps * 1e3
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        print(f"{name}: decode step {step_ms:.1f} ms under the profiler")
        for event in events[:top]:
            ms = event.self_cpu_time_total / 1e3 / steps
            key = "the compiled graph's own kernels" if "CompiledFxGraph" in event.key else event.key
            print(f"  {key:<44} {ms:7.2f} ms {ms / step_ms:6.1%}  {event.count // steps} calls a step")
        rest = step_ms - sum(e.self_cpu_time_total for e in events) / 1e3 / steps
        print(f"  {'the rest (the engine around the graph)':<44} {rest:7.2f} ms {rest / step_ms:6.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="decode rounds (each engine's turn: --steps steps)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompt-rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--eager", action="store_true", help="decode steps uncompiled (no compile wait)")
    parser.add_argument("--profile", type=int, default=0, help="then this many decode steps of each engine profiled")
    parser.add_argument("--lora-dtypes", default="float32,bfloat16",
                        help="comma-separated lora_dtype of each LoRA engine (auto, float32, bfloat16, float16)")
    args = parser.parse_args()
    compiled = {"enforce_eager": True} if args.eager else {"compile_buckets": [NUM_STREAMS]}
    engines = {"base": LLM(**compiled)}
    for dtype in args.lora_dtypes.split(","):
        engines[f"LoRA {dtype}"] = LLM(**compiled, enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=RANK,
                                       lora_dtype=dtype)
    folders = write_adapters(Path(tempfile.mkdtemp()), engines["base"].engine.hf_config, NUM_ADAPTERS, RANK)
    adapters = [LoRARequest(f"adapter-{i}", i + 1, str(f)) for i, f in enumerate(folders)]
    loras = {name: [None if name == "base" else adapters[i % NUM_ADAPTERS] for i in range(NUM_STREAMS)]
             for name in engines}
    prompts = random_workload(NUM_STREAMS, (128, 128), 8, seed=0, vocab_range=(1000, 40000)).prompts
    for name, llm in engines.items():
        if llm.engine.runner.decode_graphs is not None:
            llm.engine.runner.decode_graphs.compile_ahead(NUM_STREAMS)
        _decoding(llm, prompts, loras[name])
    decode: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                llm.engine.step()
            decode[name].append((time.perf_counter() - start) / args.steps)
        print("decode step: " + ", ".join(f"{name} {times[-1] * 1e3:.1f} ms" for name, times in decode.items()))
    _ratios(f"decode steps of {NUM_STREAMS} rows", decode, args.rounds)
    if args.profile:
        _profile(engines, args.profile)
    if args.prompt_rounds:
        _prompts(engines, loras, args.prompt_rounds, args.prompt_len)


def _prompts(engines: dict[str, LLM], loras: dict[str, list], rounds: int, prompt_len: int) -> None:
    """Prompt steps in turns: each round, 16 prompts of prompt_len tokens through each engine."""
    short = random_workload(NUM_STREAMS, (prompt_len, prompt_len), 8, seed=1,
                            vocab_range=(1000, 40000)).prompts
    prompt: dict[str, list[float]] = {name: [] for name in engines}
    for llm in engines.values():
        llm.engine.abort_request(list(llm.engine.groups))
    for _ in range(rounds):
        for name, llm in engines.items():
            llm.reset_caches()
            _add(llm, short, loras[name], 1)
            start = time.perf_counter()
            while llm.engine.has_unfinished_requests():
                llm.engine.step()
            prompt[name].append(time.perf_counter() - start)
        print("prompts: " + ", ".join(f"{name} {times[-1] * 1e3:.0f} ms" for name, times in prompt.items()))
    _ratios(f"{NUM_STREAMS} prompts of {prompt_len} tokens", prompt, rounds)


def _ratios(what: str, times: dict[str, list[float]], rounds: int) -> None:
    """Each LoRA engine's median over the rounds of (base time / its time), and against the first LoRA engine's."""
    names = [name for name in times if name != "base"]
    for name in names:
        ratio = statistics.median(b / lo for b, lo in zip(times["base"], times[name]))
        print(f"{what}: {name} / base speed {ratio:.3f} (median of {rounds} rounds)")
    for name in names[1:]:
        ratio = statistics.median(first / t for first, t in zip(times[names[0]], times[name]))
        print(f"{what}: {name} / {names[0]} speed {ratio:.3f} (median of {rounds} rounds)")


if __name__ == "__main__":
    main()
