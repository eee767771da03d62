"""The child process of tests/test_llm_lifecycle.py: engines made and ended in turn in a fresh interpreter, its
resident memory read around each, so that nothing else of the test process is counted.

    python -m tests.rss_rounds '{"model": FOLDER, "ends": ["drop", "shutdown"], "rounds": 4, "engine": {...},
                                 "compile_ahead": false}'

Each round makes LLM(model, **engine), compiles its decode steps first with compile_ahead (else they compile in the
background, as configured), generates a few tokens for two prompts, writes its whole KV cache (this process's
ranks'), and ends the engine the round's way
(ends, taken in turn): "drop" (del, gc.collect()), "shutdown" (shutdown(); the name still holds the LLM) or "with"
(the end of a `with LLM(...) as llm:` block; the name still holds it). It prints one JSON line:

    {"start": MiB before the first engine, "rounds": [{"alive": MiB, "ended": MiB, "children": [live child pids],
     "error": what generate raised after the end (None: nothing, or the LLM was dropped)}]}
"""

from __future__ import annotations

import gc
import json
import sys

import psutil

from kvforge import LLM, SamplingParams

PROMPTS = ["The quick brown fox", "Paris is the capital"]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def live_children() -> list[int]:
    return [c.pid for c in psutil.Process().children() if c.status() != psutil.STATUS_ZOMBIE]


def generate(llm: LLM, compile_ahead: bool) -> None:
    runner = llm.engine.runner
    if compile_ahead:
        runner.decode_graphs.compile_ahead(runner.decode_graphs.max_batch)
    llm.generate(PROMPTS, PARAMS)
    # NOTE: a CPU cache is backed page by page as it is first written (platforms/zeroed_memory.py): written whole here,
    # as a busy engine's is, so that an engine left behind would keep all of it resident
    for layer in runner.kv_caches:
        for cache in layer:
            cache.fill_(0)


def one_round(model: str, end: str, engine: dict, compile_ahead: bool) -> dict:
    if end == "with":
        with LLM(model, **engine) as llm:
            generate(llm, compile_ahead)
            alive = rss_mib()
    else:
        llm = LLM(model, **engine)
        generate(llm, compile_ahead)
        alive = rss_mib()
        if end == "shutdown":
            llm.shutdown()
        else:
            del llm
    gc.collect()
    error = None
    if end != "drop":
        try:
            llm.generate(PROMPTS, PARAMS)
        except RuntimeError as err:
            error = str(err)
    return {"alive": alive, "ended": rss_mib(), "children": live_children(), "error": error}


def main() -> None:
    args = json.loads(sys.argv[1])
    start = rss_mib()
    ends = args["ends"]
    rounds = [one_round(args["model"], ends[i % len(ends)], args["engine"], args.get("compile_ahead", False))
              for i in range(args["rounds"])]
    print(json.dumps({"start": start, "rounds": rounds}))


if __name__ == "__main__":
    main()
