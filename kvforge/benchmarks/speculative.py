"""`kvforge bench speculative`: decode speed with speculation off and with each method, side by side.

Two shipped workloads of chat prompts (kvforge/data/workloads): `grounded` asks the model to repeat or copy
and extend a given passage or piece of code (the drafts can come from the prompt), `chat` asks open
questions with no source text. Each method gets a fresh engine per stream count (one that served the same
prompts at another count would hold their answers in its suffix trie and its measured step costs), shared by
the workloads; single-stream requests take turns across the methods prompt by prompt (so a drifting machine
load slows all alike), concurrent ones run all prompts at once, method after method. With --rounds R the whole
measurement repeats R times, methods alternating within each round, and every round starts from engines that
forgot the earlier rounds (`reset_caches`: no prefix-cache hits, no suffix trie of answers already given), so
that a drifting machine shows as a spread of per-round ratios rather than as one method's luck. Greedy decoding,
so every method generates the same tokens; reported: decode tokens/s (single stream: after each first token;
concurrent: all output tokens over the wall time) summed over the rounds, the ratio to speculation off (overall
and per round), the acceptance rate per draft position and the mean accepted length.
"""

from __future__ import annotations

import argparse
import json
import time
from importlib import resources

from kvforge.engine.stats import SpecDecodeStats
from kvforge.engine_args import add_engine_arguments, engine_kwargs_from_args

WORKLOADS = ("grounded", "chat")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", default="grounded,chat", help="comma-separated, of " + ", ".join(WORKLOADS))
    parser.add_argument("--methods", default="off,ngram,suffix",
                        help="comma-separated speculative methods to compare (off: no speculation, first)")
    parser.add_argument("--streams", default="1,16", help="comma-separated concurrency levels")
    parser.add_argument("--num-prompts", type=int, default=16, help="prompts of each workload used")
    parser.add_argument("--output-len", type=int, default=128, help="most tokens per answer (EOS ends earlier)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat the measurement, methods alternating, each round from forgotten caches")
    parser.add_argument("--json", default=None, help="also write the result to this JSON file")
    add_engine_arguments(parser)


def load_chat_workload(name: str) -> list[list[dict]]:
    """The conversations of a shipped workload."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; the workloads are {WORKLOADS}")
    text = resources.files("kvforge.data").joinpath(f"workloads/{name}.jsonl").read_text()
    return [json.loads(line)["messages"] for line in text.splitlines() if line.strip()]


# warm-up: a copying task that is in no workload, so that verification steps of every size run (and compile)
WARMUP = [{"role": "user", "content": "Repeat exactly: one two three four five six seven eight nine ten. "
                                      "Red green blue yellow. One two three four five six seven eight nine ten."}]


def _engines(args: argparse.Namespace, methods: list[str], streams: int) -> dict:
    from kvforge import LLM

    kwargs = engine_kwargs_from_args(args)
    kwargs["kv_cache_memory"] = kwargs["kv_cache_memory"] or "512MiB"  # several engines in one process
    kwargs["compile_after"] = 0  # every bucket compiles in the warm-up, not while timed
    engines = {}
    for method in methods:
        engine = LLM(**{**kwargs, "speculative_method": None if method == "off" else method}).engine
        prompt = engine.tokenizer.apply_chat_template(WARMUP, add_generation_prompt=True, tokenize=True)
        _run(engine, [prompt] * streams, 64, f"warmup-{streams}")
        graphs, max_rows = engine.runner.decode_graphs, engine.config.speculative.speculative_max_rows
        if graphs is not None:  # the row counts the warm-up did not reach (steps with drafts have <= max_rows)
            graphs.compile_ahead(max(streams, 0 if method == "off" else max_rows))
        draft = engine.runner.draft
        if draft is not None and draft.graphs is not None:  # the draft model's steps: a row per drafting stream
            draft.graphs.compile_ahead(streams)
        engines[method] = engine
    return engines


def _run(engine, prompts: list[list[int]], output_len: int, tag: str) -> tuple[int, float]:
    """(output tokens after each request's first, seconds they took) of prompts run together."""
    from kvforge import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len)
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{index}", {"prompt_token_ids": prompt}, params)
    first, num_tokens = None, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                num_tokens += len(output.outputs[0].token_ids)
        first = first or time.perf_counter()
    if len(prompts) == 1:
        return num_tokens - 1, time.perf_counter() - first
    return num_tokens, time.perf_counter() - start


def _spec_delta(after: SpecDecodeStats, before: SpecDecodeStats) -> SpecDecodeStats:
    if not after.num_drafted_per_position:
        return after
    minus = lambda a, b: tuple(x - y for x, y in zip(a, b or (0,) * len(a)))  # noqa: E731
    return SpecDecodeStats(after.num_verified_requests - before.num_verified_requests,
                           minus(after.num_drafted_per_position, before.num_drafted_per_position),
                           minus(after.num_accepted_per_position, before.num_accepted_per_position))


def _measure(engines: dict, prompts: list[list[int]], streams: int, output_len: int, rounds: int,
             tag: str) -> dict:
    """Per method: [tokens, seconds] of each round and the speculation counters of this measurement."""
    totals = {m: [[0, 0.0] for _ in range(rounds)] for m in engines}
    before = {m: e.stats().spec_decode for m, e in engines.items()}
    groups = [prompts[i : i + streams] for i in range(0, len(prompts), streams)]
    for round_index in range(rounds):
        for engine in engines.values():
            engine.reset_caches()
        for index, group in enumerate(groups):
            for method, engine in engines.items():
                tokens, seconds = _run(engine, group, output_len, f"{tag}-{streams}-{round_index}-{index}")
                totals[method][round_index][0] += tokens
                totals[method][round_index][1] += seconds
    return {m: (totals[m], _spec_delta(e.stats().spec_decode, before[m])) for m, e in engines.items()}


def _rate(rounds: list[list]) -> float:
    return sum(tokens for tokens, _ in rounds) / sum(seconds for _, seconds in rounds)


def _row(workload: str, streams: int, method: str, rounds: list[list], baseline: list[list],
         spec: SpecDecodeStats) -> dict:
    return {"workload": workload, "streams": streams, "method": method, "tokens_per_s": round(_rate(rounds), 2),
            "vs_off": round(_rate(rounds) / _rate(baseline), 3),
            "vs_off_per_round": [round(_rate([r]) / _rate([b]), 3) for r, b in zip(rounds, baseline)],
            "acceptance_per_position": [round(a, 3) for a in spec.acceptance_per_position],
            "mean_accepted_length": round(spec.mean_accepted_length, 3)}


def _print(row: dict) -> None:
    acceptance = " ".join(f"{a:.2f}" for a in row["acceptance_per_position"]) or "-"
    per_round = " ".join(f"{r:.2f}" for r in row["vs_off_per_round"])
    print(f"{row['workload']:<9} {row['streams']:>7}  {row['method']:<7} {row['tokens_per_s']:>9.2f} "
          f"{row['vs_off']:>7.3f}x  {per_round:<{5 * len(row['vs_off_per_round'])}}  "
          f"{row['mean_accepted_length']:>5.2f}  {acceptance}")


def run(args: argparse.Namespace) -> int:
    methods = [m.strip() for m in args.methods.split(",")]
    if methods[0] != "off":
        raise ValueError(f"--methods must start with off (the baseline), got {args.methods!r}")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    stream_counts = [int(s) for s in args.streams.split(",")]
    workloads = [w.strip() for w in args.workloads.split(",")]
    conversations = {w: load_chat_workload(w)[: args.num_prompts] for w in workloads}
    rows = []
    print(f"{'workload':<9} {'streams':>7}  {'method':<7} {'tok/s':>9} {'vs off':>8}  "
          f"{'per round':<{5 * args.rounds}}  {'mean':>5}  acceptance/pos")
    for streams in stream_counts:
        engines = _engines(args, methods, streams)
        tokenizer = next(iter(engines.values())).tokenizer
        for workload in workloads:
            prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True)
                       for c in conversations[workload]]
            measured = _measure(engines, prompts, streams, args.output_len, args.rounds, workload)
            baseline = measured["off"][0]
            for method, (rounds, spec) in measured.items():
                rows.append(_row(workload, streams, method, rounds, baseline, spec))
                _print(rows[-1])
        for engine in engines.values():
            engine.shutdown()
    if args.json:
        with open(args.json, "w") as handle:
            result = {"output_len": args.output_len, "num_prompts": args.num_prompts, "rounds": args.rounds,
                      "rows": rows}
            json.dump(result, handle, indent=2)
    return 0
