"""KV cache memory of models with sliding-window layers, with and without window-aware allocation: computed from the
engine's own KV cache spec and manager (no model is loaded, nothing is timed).

    python -m kvforge.benchmarks.kv_window_memory [--model gemma-3-12b,gpt-oss-20b] [--budget 16GiB]
        [--context 4096,32768] [--block-size 16] [--kv-bytes 2]

Per model and context length C, a sequence of C tokens:

    bytes/token   its KV cache bytes divided by C: every layer keeps C tokens without window-aware allocation; with
                  it, a sliding-window layer keeps the blocks of its window only (the most the manager holds while
                  decoding: ceil((W - 1) / block_size) + 1 blocks)
    sequences     how many such sequences a cache of --budget bytes holds at once, and the tokens they hold

The layer groups and block counts are the KV cache manager's (KVCacheSpec.layer_groups, its groups' max_blocks_held);
--model takes the names of the configs shipped with kvforge (kvforge/data/configs) or a config.json path.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from kvforge.config import parse_bytes
from kvforge.engine.block_pool import BlockPool
from kvforge.engine.cache_groups import make_group
from kvforge.layers.kv_cache_spec import KVCacheSpec, layer_windows


@dataclass(frozen=True, slots=True)
class WindowMemory:
    """One model at one context length: bytes per token and sequences a budget holds, without and with windows."""

    model: str
    context: int
    plain_bytes_per_token: float
    window_bytes_per_token: float
    plain_sequences: int
    window_sequences: int


def read_config(model: str) -> dict:
    path = Path(model)
    if path.is_file():
        return json.loads(path.read_text())
    return json.loads((resources.files("kvforge.data") / "configs" / f"{model}.json").read_text())


def kv_spec(hf_config: dict) -> KVCacheSpec:
    """A key and a value of the model's KV heads per layer, with its layers' sliding windows."""
    heads = hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]
    per_head = (heads, head_dim)
    windows = layer_windows(hf_config, default_pattern=hf_config["num_hidden_layers"] + 1)
    return KVCacheSpec(((per_head, per_head),) * hf_config["num_hidden_layers"], layer_windows=windows)


def _blocks_per_sequence(spec: KVCacheSpec, context: int, block_size: int) -> int:
    """Pool blocks one sequence of context tokens holds at most, over the manager's layer groups."""
    pool = BlockPool(2, enable_caching=False)
    return sum(make_group(g, layers, pool, block_size).max_blocks_held(context)
               for g, layers in enumerate(spec.layer_groups()))


def window_memory(model: str, context: int, budget: int, block_size: int, kv_bytes: int) -> WindowMemory:
    spec = kv_spec(read_config(model))
    plain = KVCacheSpec(spec.layer_shapes)  # every layer keeps every token
    results = []
    for layout in (plain, spec):
        slot_bytes = layout.bytes_per_token(_dtype_of(kv_bytes))  # per token slot of a block
        per_sequence = _blocks_per_sequence(layout, context, block_size) * block_size * slot_bytes
        results.append((per_sequence / context, int(budget // per_sequence)))
    (plain_per_token, plain_seqs), (window_per_token, window_seqs) = results
    return WindowMemory(model, context, plain_per_token, window_per_token, plain_seqs, window_seqs)


def _dtype_of(kv_bytes: int):
    import torch

    return {1: torch.int8, 2: torch.bfloat16, 4: torch.float32}[kv_bytes]


def format_table(rows: list[WindowMemory], budget: int) -> str:
    gib = budget / 2**30
    lines = [f"| model | context | KiB/token, every layer | KiB/token, window-aware | sequences in {gib:g} GiB "
             f"(tokens), every layer | window-aware | gain |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.model} | {r.context:,} | {r.plain_bytes_per_token / 1024:.1f} | "
                     f"{r.window_bytes_per_token / 1024:.1f} | {r.plain_sequences} ({r.plain_sequences * r.context:,})"
                     f" | {r.window_sequences} ({r.window_sequences * r.context:,}) | "
                     f"{r.plain_bytes_per_token / r.window_bytes_per_token:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma-3-12b,gpt-oss-20b", help="comma-separated config names or paths")
    parser.add_argument("--budget", default="16GiB", help="KV cache bytes")
    parser.add_argument("--context", default="4096,32768", help="comma-separated tokens per sequence")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-bytes", type=int, default=2, choices=(1, 2, 4), help="bytes per cached value")
    args = parser.parse_args(argv)
    budget = parse_bytes(args.budget)
    rows = [window_memory(model, int(context), budget, args.block_size, args.kv_bytes)
            for model in args.model.split(",") for context in args.context.split(",")]
    print(format_table(rows, budget))


if __name__ == "__main__":
    main()
