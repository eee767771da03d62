"""The draft model's decode steps compiled against eager, in one process: one engine drafting with a draft model (by
default the default model drafting for itself, single stream, greedy), its draft's compiled decode graphs switched on
and off between rounds (compiled, eager, compiled, ...). Each pair's ratio is compiled speed / eager speed (decode
tokens per second after the first token); the median is printed. For a shared, noisy machine:

    python scripts/bench_draft_compiled_vs_eager.py --rounds 8 --output-len 48 [--model M --speculative-model D]
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvforge import LLM, SamplingParams

PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a bottle."}]


def _decode_speed(llm: LLM, prompt: list[int], output_len: int, tag: str) -> float:
    """Decode tokens per second of one greedy request, from its first token on."""
    engine = llm.engine
    engine.add_request(tag, {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
    first, num_tokens = None, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                num_tokens = len(output.outputs[0].token_ids)
        first = first or time.perf_counter()
    return (num_tokens - 1) / (time.perf_counter() - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="the target (default: the default model)")
    parser.add_argument("--speculative-model", default=None, help="the draft (default: the target's GGUF file)")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=48)
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
    graphs = runner.draft.graphs
    _decode_speed(llm, prompt, args.output_len, "warmup")
    ratios = []
    for index in range(args.rounds):
        speeds = {}
        for mode in ("compiled", "eager"):
            runner.draft.graphs = graphs if mode == "compiled" else None
            speeds[mode] = _decode_speed(llm, prompt, args.output_len, f"{mode}-{index}")
        ratios.append(speeds["compiled"] / speeds["eager"])
        print(f"round {index}: compiled {speeds['compiled']:.1f} tok/s, eager {speeds['eager']:.1f} tok/s, "
              f"ratio {ratios[-1]:.3f}", flush=True)
    runner.draft.graphs = graphs
    stats = llm.engine.stats().spec_decode
    print(f"median compiled/eager decode speed: {statistics.median(ratios):.3f} over {len(ratios)} rounds "
          f"(acceptance {stats.acceptance_rate:.2f})")
    llm.shutdown()


if __name__ == "__main__":
    main()
