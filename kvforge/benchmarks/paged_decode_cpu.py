"""The CPU's decode attention kernel (csrc/paged_decode.cpp) over a model's worth of layers, against the machine's
read bandwidth, on the default model's geometry (SmolLM2-135M: 9 query heads, 3 kv heads, head dim 64, 30 layers).

    python -m kvforge.benchmarks.paged_decode_cpu [--threads 2] [--seqs 1,16,64] [--context 214] [--rounds 9]

Each layer has its own float32 cache, its blocks in random order (as a long-running engine's are), so the keys and
values stream from memory as they do in a decode step. Reported per batch: the time for the 30 layers, the GB/s of
keys and values read, and the fraction of the machine's read bandwidth that is (a 1 GiB tensor summed, timed in the
same rounds, in turn with the kernel); each keeps its fastest round.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvforge.kernels.cpu.extension import cpu_kernels
from kvforge.kernels.cpu.paged_attention import paged_decode_cpu

NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 9, 3, 64, 16


def _time(fn, best: dict[str, float], name: str) -> None:
    start = time.perf_counter()
    fn()
    best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)


def run(num_seqs: int, context: int, rounds: int, generator: torch.Generator) -> None:
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
              for _ in range(NUM_LAYERS)]
    tables = torch.randperm(num_blocks, generator=generator).to(torch.int32).view(num_seqs, blocks_per_seq)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32)
    query = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM, generator=generator)
    scale = HEAD_DIM**-0.5
    nbytes = NUM_LAYERS * 2 * num_seqs * context * NUM_KV_HEADS * HEAD_DIM * 4
    big = torch.ones(1 << 28)  # 1 GiB of float32
    best: dict[str, float] = {}
    with torch.inference_mode():
        for _ in range(rounds):
            _time(lambda: [paged_decode_cpu(query, k, v, tables, seq_lens, scale) for k, v in caches], best, "kernel")
            _time(big.sum, best, "read")
    read_bw = big.numel() * 4 / best.pop("read") / 1e9
    print(f"{num_seqs} sequences x {context} tokens, {NUM_LAYERS} layers: {nbytes / 1e6:.0f} MB of keys and values; "
          f"read bandwidth {read_bw:.1f} GB/s")
    seconds = best["kernel"]
    gbs = nbytes / seconds / 1e9
    print(f"  kernel {seconds * 1e3:8.2f} ms  {gbs:6.1f} GB/s  {gbs / read_bw:5.0%} of read")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seqs", default="1,16,64", help="comma-separated batch sizes")
    parser.add_argument("--context", type=int, default=214, help="tokens of context per sequence")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    if cpu_kernels() is None:
        raise SystemExit("the C++ CPU kernels are not built on this machine")
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    for num_seqs in (int(s) for s in args.seqs.split(",")):
        run(num_seqs, args.context, args.rounds, generator)


if __name__ == "__main__":
    main()
