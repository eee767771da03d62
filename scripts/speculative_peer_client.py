"""The llama.cpp side of scripts/bench_speculative_vs_llamacpp.sh: the workloads of `kvforge bench speculative`
against a running llama-server, measured as kvforge measures them.

Greedy chat completions of at most --output-len tokens. Single stream: the requests one after another, decode
tokens/s from the server's own timings (predicted_n over predicted_ms: after the prompt, as kvforge counts
after each first token); N streams: groups of N requests at once, all output tokens over the wall time.
Acceptance: the server's draft_n_accepted over draft_n (0 without speculation).
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from kvforge.benchmarks.speculative import load_chat_workload


def _complete(url: str, messages: list[dict], output_len: int) -> dict:
    body = json.dumps({"messages": messages, "temperature": 0.0, "max_tokens": output_len}).encode()
    request = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as response:
        return json.load(response)


def _measure(url: str, conversations: list[list[dict]], streams: int, output_len: int) -> dict:
    tokens, seconds, drafted, accepted = 0, 0.0, 0, 0
    groups = [conversations[i : i + streams] for i in range(0, len(conversations), streams)]
    with ThreadPoolExecutor(streams) as pool:
        for group in groups:
            start = time.perf_counter()
            results = list(pool.map(lambda c: _complete(url, c, output_len), group))
            wall = time.perf_counter() - start
            timings = [r["timings"] for r in results]
            if streams == 1:
                tokens += timings[0]["predicted_n"]
                seconds += timings[0]["predicted_ms"] / 1000
            else:
                tokens += sum(r["usage"]["completion_tokens"] for r in results)
                seconds += wall
            drafted += sum(t.get("draft_n", 0) for t in timings)
            accepted += sum(t.get("draft_n_accepted", 0) for t in timings)
    return {"tokens_per_s": round(tokens / seconds, 2), "acceptance": round(accepted / drafted, 3) if drafted else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--label", required=True, help="what the server runs (e.g. off, ngram)")
    parser.add_argument("--workloads", default="grounded,chat")
    parser.add_argument("--streams", default="1,16")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    rows = []
    for workload in args.workloads.split(","):
        conversations = load_chat_workload(workload.strip())[: args.num_prompts]
        for streams in (int(s) for s in args.streams.split(",")):
            measured = _measure(args.url, conversations, streams, args.output_len)
            rows.append({"workload": workload.strip(), "streams": streams, "method": args.label, **measured})
            print(rows[-1], flush=True)
    with open(args.json, "w") as handle:
        json.dump({"rows": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
