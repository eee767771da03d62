"""The draft model's decode steps compiled against eager, in one process: one engine drafting with a draft model (by
default the default model drafting for itself, single stream, greedy), its draft's compiled decode graphs switched on
and off before every engine step (compiled, eager, compiled, ...), each proposal of the draft timed. Prints the median
proposal time of each mode and their ratio (eager / compiled), and the median step time of each mode (a step: the
target's verification and the next proposal). For a shared, noisy machine:

    python scripts/bench_draft_compiled_vs_eager.py --requests 6 --output-len 64 [--model M --speculative-model D]
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvforge import LLM, SamplingParams

PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a bottle."}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="the target (default: the default model)")
    parser.add_argument("--speculative-model", default=None, help="the draft (default: the target's GGUF file)")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--requests", type=int, default=6, help="requests timed, one after the other")
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    kwargs = {} if args.model is None else {"model": args.model}
    llm = LLM(**kwargs, kv_cache_memory="256MiB", speculative_method="draft", speculative_model=args.speculative_model,
              num_speculative_tokens=args.num_speculative_tokens, speculative_adaptive=False, compile_after=0,
              compile_at_start=False)
    runner = llm.engine.runner
    rows = args.num_speculative_tokens + 1
    runner.decode_graphs.compile_ahead(rows)  # the target's steps: 1 row, or a row and its drafts
    runner.draft.graphs.compile_ahead(1)
    prompt = llm.engine.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)
    draft, graphs = runner.draft, runner.draft.graphs
    propose = draft.propose
    proposals: dict[str, list[float]] = {"compiled": [], "eager": []}
    steps: dict[str, list[float]] = {"compiled": [], "eager": []}
    mode = "eager"

    def timed_propose(*call_args):
        start = time.perf_counter()
        drafts = propose(*call_args)
        proposals[mode].append(time.perf_counter() - start)
        return drafts

    draft.propose = timed_propose
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    engine = llm.engine
    for index in range(args.requests + 1):  # the first request warms up
        engine.add_request(f"r{index}", {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            mode = "compiled" if mode == "eager" else "eager"
            draft.graphs = graphs if mode == "compiled" else None
            start = time.perf_counter()
            engine.step()
            steps[mode].append(time.perf_counter() - start)
        if index == 0:
            for times in (*proposals.values(), *steps.values()):
                times.clear()
    draft.graphs = graphs
    median = {m: statistics.median(times) * 1e3 for m, times in proposals.items()}
    step = {m: statistics.median(times) * 1e3 for m, times in steps.items()}
    print(f"proposals: compiled {median['compiled']:.2f} ms, eager {median['eager']:.2f} ms (medians of "
          f"{len(proposals['compiled'])} / {len(proposals['eager'])}): eager / compiled "
          f"{median['eager'] / median['compiled']:.3f}")
    print(f"steps: compiled {step['compiled']:.2f} ms, eager {step['eager']:.2f} ms: eager / compiled "
          f"{step['eager'] / step['compiled']:.3f} (acceptance {engine.stats().spec_decode.acceptance_rate:.2f})")
    llm.shutdown()


if __name__ == "__main__":
    main()
