"""Host time of a many-stream eager decode step, part by part, at any commit (the engine's own functions timed in
place, as `kvforge profile` does, without its profiler). One engine (the default model unless --model), --streams
requests decoding at once (greedy, ignore_eos); each decode step of exactly --streams sequences after --warmup such
steps is timed: the whole `engine.step()` and, inside it,

    schedule       scheduler.schedule + grammar_bitmask
    runner.update  the runner's request states taking the step's news (runner._update_requests)
    runner.prepare the step's flat inputs and attention metadata (runner._prepare)
    model          runner._forward + model.compute_logits (not host time)
    sample.prepare the sampling settings gathered (runner._sampling_batch)
    sample.sampler the sampler itself (greedy: argmax and the ids read back)
    sample.other   the rest of runner._sample (results per request)
    runner.other   the rest of runner.execute (context managers, state saves, logits rows)
    update         scheduler.update_from_output
    detokenize     engine._record (detokenizer, stop strings)
    engine.other   the rest of engine.step (outputs, the executor's calls)
    host           step - model

Prints the medians (microseconds) as JSON. Run one tree, or alternate source trees process by process:

    PYTHONPATH=<tree> python scripts/bench_step_host.py [--streams 64 --steps 240] [--json out.json]
    python scripts/bench_step_host.py --trees BEFORE_TREE AFTER_TREE [...] --rounds 3 [--json summary.json]

With --trees each run is a process of its own with PYTHONPATH and the working directory set to its tree (first,
second, ..., first, second, ...); the summary holds each part's median over the rounds of the runs' medians, each
tree's ratio to the first, and whether the greedy tokens of every run are the same.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PARTS = ("schedule", "runner.update", "runner.prepare", "model", "sample.prepare", "sample.sampler", "sample.other",
         "runner.other", "update", "detokenize", "engine.other", "host", "step")


class StepClock:
    """Inclusive nanoseconds of each wrapped call in the current step, summed by name."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = {}

    def wrap(self, obj: object, attribute: str, name: str) -> None:
        """obj.attribute (a method or callable) replaced, on the instance, by a timed call of itself."""
        fn = getattr(obj, attribute)
        ns = self.ns
        clock = time.perf_counter_ns

        def timed(*args, **kwargs):
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                ns[name] = ns.get(name, 0) + clock() - start

        setattr(obj, attribute, timed)


def exclusive_parts(ns: dict[str, int], step_ns: int) -> dict[str, int]:
    """The step's parts (PARTS) from the inclusive times of the wrapped calls."""
    get = ns.get
    model = get("forward", 0) + get("compute_logits", 0)
    sample = get("sample", 0)
    parts = {"schedule": get("schedule", 0) + get("grammar_bitmask", 0), "runner.update": get("runner.update", 0),
             "runner.prepare": get("runner.prepare", 0), "model": model,
             "sample.prepare": get("sample.prepare", 0), "sample.sampler": get("sample.sampler", 0)}
    parts["sample.other"] = sample - parts["sample.prepare"] - parts["sample.sampler"]
    parts["runner.other"] = get("execute", 0) - parts["runner.update"] - parts["runner.prepare"] - model - sample
    parts["update"] = get("update", 0)
    parts["detokenize"] = get("detokenize", 0)
    parts["engine.other"] = step_ns - get("execute", 0) - parts["schedule"] - parts["update"] - parts["detokenize"]
    parts["host"] = step_ns - model
    parts["step"] = step_ns
    return parts


def instrument(engine) -> StepClock:
    clock = StepClock()
    runner = engine.runner
    for obj, attribute, name in (
            (engine.scheduler, "schedule", "schedule"), (engine.scheduler, "grammar_bitmask", "grammar_bitmask"),
            (engine.scheduler, "update_from_output", "update"), (engine, "_record", "detokenize"),
            (runner, "execute", "execute"), (runner, "_update_requests", "runner.update"),
            (runner, "_prepare", "runner.prepare"), (runner, "_forward", "forward"),
            (runner.model, "compute_logits", "compute_logits"), (runner, "_sample", "sample"),
            (runner, "_sampling_batch", "sample.prepare"), (runner, "sampler", "sample.sampler")):
        clock.wrap(obj, attribute, name)
    return clock


def prompt_of(index: int, length: int) -> list[int]:
    """A fixed prompt per stream (the same ids in every tree)."""
    return [100 + (index * 131 + position * 17) % 20000 for position in range(length)]


def run_one(args: argparse.Namespace) -> dict:
    """Build the engine, fill args.streams decode streams, time args.steps decode steps; the medians."""
    import torch

    from kvforge import LLM, SamplingParams

    torch.manual_seed(0)
    if args.threads is not None:  # (one thread is robust on a busy machine: no worker waits for a descheduled one)
        torch.set_num_threads(args.threads)
    kwargs = {} if args.model is None else {"model": args.model}
    llm = LLM(**kwargs, enforce_eager=True, kv_cache_memory=args.kv_cache_memory)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=args.warmup + args.steps + 64, ignore_eos=True)
    for index in range(args.streams):
        engine.add_request(f"s{index}", {"prompt_token_ids": prompt_of(index, args.input_len)}, params)
    clock = instrument(engine)
    schedule = engine.scheduler.schedule
    shapes: list[tuple[int, int]] = []

    def schedule_noting_shape(*call_args, **call_kwargs):
        output = schedule(*call_args, **call_kwargs)
        shapes.append((len(output.scheduled), sum(len(s.token_ids) for s in output.scheduled)))
        return output

    engine.scheduler.schedule = schedule_noting_shape
    samples: list[dict[str, int]] = []
    num_decode_steps = 0
    tokens: dict[str, list[int]] = {}
    while len(samples) < args.steps:
        shapes.clear()
        clock.ns.clear()
        start = time.perf_counter_ns()
        outputs = engine.step()
        step_ns = time.perf_counter_ns() - start
        for output in outputs:
            tokens[output.request_id] = list(output.outputs[0].token_ids)
        if shapes != [(args.streams, args.streams)]:  # prefill, or not every stream
            assert not samples, f"a step of {shapes} (sequences, tokens) among the timed decode steps"
            continue
        num_decode_steps += 1
        if num_decode_steps > args.warmup:
            samples.append(exclusive_parts(clock.ns, step_ns))
    llm.shutdown()
    digest = hashlib.sha256(json.dumps([tokens[f"s{i}"] for i in range(args.streams)]).encode()).hexdigest()
    result = {part: statistics.median(s[part] for s in samples) / 1e3 for part in PARTS}
    return {"median_us": result, "mean_host_us": statistics.fmean(s["host"] for s in samples) / 1e3,
            "steps": len(samples), "streams": args.streams, "threads": torch.get_num_threads(),
            "tokens_sha256": digest[:16], "tree": str(Path(sys.modules["kvforge"].__file__).parent.parent)}


def run_trees(args: argparse.Namespace, forwarded: list[str]) -> dict:
    """Alternate the trees (the first is the baseline), one process per run; each part's median over the rounds,
    and each other tree's ratio to the first."""
    labels = [f"{index}:{Path(tree).resolve().name}" for index, tree in enumerate(args.trees)]
    runs: dict[str, list[dict]] = {label: [] for label in labels}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            for index, (label, tree) in enumerate(zip(labels, args.trees)):
                out = Path(scratch) / f"{index}_{round_index}.json"
                env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()))
                subprocess.run([sys.executable, str(Path(__file__).resolve()), *forwarded, "--json", str(out)],
                               cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
                runs[label].append(json.loads(out.read_text()))
                medians = runs[label][-1]["median_us"]
                print(f"round {round_index + 1} {label}: host {medians['host']:.0f} us, step {medians['step']:.0f} us",
                      file=sys.stderr)
    parts = {}
    for part in PARTS:
        medians = {label: statistics.median(r["median_us"][part] for r in runs[label]) for label in labels}
        base = medians[labels[0]]
        parts[part] = {label: round(value, 1) for label, value in medians.items()}
        parts[part] |= {f"{label}/{labels[0]}": round(medians[label] / base, 3) if base > 0 else None
                        for label in labels[1:]}
    same = len({r["tokens_sha256"] for label in labels for r in runs[label]}) == 1
    return {"trees": labels, "rounds": args.rounds, "greedy_tokens_same": same, "median_us": parts, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=16, help="decode steps run before the timed ones")
    parser.add_argument("--steps", type=int, default=240, help="decode steps timed")
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--trees", nargs="+", metavar="TREE",
                        help="source trees to alternate, one run each per round (ratios against the first)")
    parser.add_argument("--rounds", type=int, default=3, help="with --trees: runs of each tree")
    parser.add_argument("--json", default=None, help="write the result here too")
    args = parser.parse_args()
    if args.trees:
        forwarded = [arg for name in ("model", "streams", "input_len", "warmup", "steps", "kv_cache_memory", "threads")
                     if (value := getattr(args, name)) is not None
                     for arg in (f"--{name.replace('_', '-')}", str(value))]
        result = run_trees(args, forwarded)
    else:
        result = run_one(args)
    text = json.dumps(result if not args.trees else {k: v for k, v in result.items() if k != "runs"}, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
