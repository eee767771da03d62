"""The CPU's weight-only matmuls at decode sizes: fp32 F.linear against the C++ kernels (csrc/quant_gemv.cpp)
and torch's prepacked int8pack / int4pack, on the default model's layer shapes (SmolLM2-135M).

    python -m kvforge.benchmarks.quant_gemv_cpu [--threads 1] [--tokens 1,4,16] [--rounds 10]

Two tables: each shape alone, its weights warm in cache; and a whole model's worth of layers (30 x qkv, o,
gate_up, down) one after the other, whose weights stream from memory as they do in decode. Variants take
turns (A B C A B C ...) and each keeps its fastest round, so load from other processes that comes and goes
hurts them alike; times are CPU time of the calling thread (wall time with more than one thread).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvforge.kernels.cpu import packed_gemm
from kvforge.kernels.cpu.quant_gemv import native_kernels_available, pack_weight, quant_linear_cpu
from kvforge.quantization.quantized_weight import QuantizedWeight

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate_up, down: (N, K)
NUM_LAYERS = 30
GROUP_SIZE = 64  # of the 4-bit weights; 8-bit ones have one scale per row (w8a16)


def _random_weight(num_rows: int, in_features: int, bits: int, generator: torch.Generator) -> QuantizedWeight:
    group_size = GROUP_SIZE if bits == 4 else in_features
    codes = torch.randint(0, 2**bits, (num_rows, in_features), dtype=torch.uint8, generator=generator)
    scales = torch.rand(num_rows, in_features // group_size, generator=generator) * 0.01
    zeros = torch.full_like(scales, 2 ** (bits - 1))  # symmetric: int8pack takes these
    return QuantizedWeight(codes, scales, zeros, bits)


def _layer_calls(num_rows: int, in_features: int, generator: torch.Generator) -> dict[str, Callable]:
    """One (x -> x W^T) per variant for a random weight of this shape."""
    weight = torch.randn(num_rows, in_features, generator=generator)
    int8, int4 = (_random_weight(num_rows, in_features, bits, generator) for bits in (8, 4))
    calls: dict[str, Callable] = {"fp32": lambda x: F.linear(x, weight)}
    if native_kernels_available():
        native8 = pack_weight(int8.codes, int8.scales, int8.zeros, 8)
        native4 = pack_weight(int4.codes, int4.scales, int4.zeros, 4)
        calls["native int8"] = lambda x: quant_linear_cpu(x, *native8, 8)
        calls["native int4"] = lambda x: quant_linear_cpu(x, *native4, 4)
    if packed_gemm.int8pack_eligible(int8):
        packed8 = packed_gemm.prepack_int8(int8)
        calls["int8pack"] = lambda x: packed_gemm.int8pack_linear(x, *packed8)
    if packed_gemm.int4pack_eligible(int4):
        packed4 = packed_gemm.prepack_int4(int4)
        calls["int4pack"] = lambda x: packed_gemm.int4pack_linear(x, *packed4, GROUP_SIZE)
    return calls


def _fastest(programs: dict[str, Callable[[], object]], rounds: int, clock: Callable[[], float]) -> dict[str, float]:
    best = dict.fromkeys(programs, float("inf"))
    for _ in range(rounds):
        for name, program in programs.items():
            start = clock()
            program()
            best[name] = min(best[name], clock() - start)
    return best


def _print_row(label: str, times: dict[str, float], scale: float, unit: str) -> None:
    baseline = times["fp32"]
    cells = [f"{name} {t * scale:8.1f} {unit} ({baseline / t:4.2f}x)" for name, t in times.items()]
    print(f"{label:<22}" + "  ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", default="1,4,16", help="rows of x (decoding sequences), comma-separated")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    generator = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} thread(s), CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; times are the fastest of {args.rounds} rounds")
    token_counts = [int(t) for t in args.tokens.split(",")]
    with torch.inference_mode():
        print("\neach shape alone (weights in cache), per call:")
        for num_rows, in_features in SHAPES:
            calls = _layer_calls(num_rows, in_features, generator)
            for num_tokens in token_counts:
                x = torch.randn(num_tokens, in_features, generator=generator)
                programs = {name: (lambda c=call, x=x: [c(x) for _ in range(20)]) for name, call in calls.items()}
                times = _fastest(programs, args.rounds, clock)
                _print_row(f"{num_rows}x{in_features} M={num_tokens}", times, 1e6 / 20, "us")
        print(f"\n{NUM_LAYERS} layers of the 4 shapes (weights streamed from memory), per pass:")
        layers = [_layer_calls(n, k, generator) for _ in range(NUM_LAYERS) for n, k in SHAPES]
        for num_tokens in token_counts:
            inputs = {k: torch.randn(num_tokens, k, generator=generator) for _, k in SHAPES}
            inputs_per_layer = [inputs[k] for _ in range(NUM_LAYERS) for _, k in SHAPES]
            programs = {
                name: (lambda name=name, xs=inputs_per_layer: [calls[name](x) for calls, x in zip(layers, xs)])
                for name in layers[0]
            }
            _print_row(f"model M={num_tokens}", _fastest(programs, max(3, args.rounds // 3), clock), 1e3, "ms")


if __name__ == "__main__":
    main()
