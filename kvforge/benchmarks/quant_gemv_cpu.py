"""The CPU's decode matmuls: fp32 F.linear against the C++ kernels (csrc/dense_gemv.cpp, csrc/quant_gemv.cpp) and
torch's prepacked int8pack / int4pack, on the default model's layer shapes (SmolLM2-135M).

    python -m kvforge.benchmarks.quant_gemv_cpu [--threads 1] [--tokens 1,4,16] [--rounds 10] [--group-size 32]
        [--compiled] [--from-cpp]

"dense" is the float32 GEMV (the layers' path up to 4 rows), "onednn" oneDNN's float32 matmul on the row-major
weight and "onednn packed" on a copy in its blocked layout (the layers' path above 4 rows); the quantized C++
kernels run twice, with x in fp32 ("native w8", "native w4") and rounded to int8 per 32 columns ("... q8x", the
layers' default on AVX2), and on AVX-512 VNNI machines the panel kernel ("panels w8", "panels w4": x rounded to int8
at every row count, the layers' default there). Three tables: each shape alone, its weights warm in cache; and a
whole model's worth of layers (30 x qkv, o, gate_up, down) one after the other, and the LM head, whose weights
stream from memory as they do in decode. In the model pass the panel kernel also runs as the engine calls it
("panels w4 arena": the weights interleaved by thread, part t of every weight one after another in region t of one
arena in the order of the calls, quantization/weight_only_kernels.py's interleaved_views, in 2 MiB pages where Linux
offers them; "... arena 4K" the same in 4 KiB pages), and with --compiled that pass also runs as one graph compiled
the way the engine compiles its decode step ("... arena compiled": Inductor, its C++ wrapper at one row), the calls
then made from C++ instead of Python (a compile of ~10 s per variant and row count), and with --from-cpp from a plain
C++ loop ("... arena from C++": the kernels with nothing of a caller's between them, timed inside the loop, so
without the conversion of its 240 arguments and 120 results between Python and C++, ~0.1 ms a pass; a build of
~30 s on first use, which also times a parallel region that does nothing, the threading cost each kernel call pays).
There each variant also gets the GB/s it reads its weights at, and the fraction of the machine's copy bandwidth that
is (a 1 GiB copy, read + write bytes, timed in the same rounds): of the fastest copy, and the median over rounds of
each round's fraction of that round's copy.
Variants take turns (A B C A B C ...) and each keeps its fastest round, so load from other processes
that comes and goes hurts them alike; times are CPU time of the calling thread (wall time with more than one
thread).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import statistics
import time
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvforge.executor.decode_graphs import CPP_WRAPPER_MAX_BATCH, inductor_options
from kvforge.kernels.cpu import builds, packed_gemm
from kvforge.kernels.cpu.dense_gemv import ONEDNN, pack_for_onednn
from kvforge.kernels.cpu.extension import CSRC, cpu_kernels
from kvforge.kernels.cpu.quant_gemv import native_kernels_available, pack_weight, quant_linear_cpu
from kvforge.kernels.cpu.quant_panels import pack_panels, panel_linear, panels_available
from kvforge.loader.huge_pages import huge_pages_offered
from kvforge.quantization.quantized_weight import QuantizedWeight
from kvforge.quantization.weight_only_kernels import interleaved_views

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate_up, down: (N, K)
LM_HEAD = (49152, 576)
NUM_LAYERS = 30


# NOTE: compiled after the kernels' declarations (the generated ops.h: builds.py), whose text thereby joins the build's
# cache key
_FROM_CPP = r"""
#include <ATen/Parallel.h>

#include <time.h>

#include <atomic>
#include <chrono>

// x_i W_i^T for each layer i of a pass, as the engine's decode step calls them.
std::vector<torch::Tensor> panel_pass(const std::vector<torch::Tensor>& xs, const std::vector<torch::Tensor>& weights,
                                      int64_t bits, const std::vector<int64_t>& out_features,
                                      const std::vector<double>& factors) {
  std::vector<torch::Tensor> outs;
  outs.reserve(xs.size());
  for (size_t i = 0; i < xs.size(); ++i)
    outs.push_back(kvforge_cpu::quant_gemm_panels(xs[i], weights[i], bits, out_features[i], factors[i]));
  return outs;
}

// The seconds panel_pass takes, timed inside C++: the calling thread's CPU time, or wall time.
double panel_pass_seconds(const std::vector<torch::Tensor>& xs, const std::vector<torch::Tensor>& weights,
                          int64_t bits, const std::vector<int64_t>& out_features, const std::vector<double>& factors,
                          bool cpu_time) {
  const auto now = [cpu_time] {
    timespec t;
    clock_gettime(cpu_time ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
  };
  const double start = now();
  panel_pass(xs, weights, bits, out_features, factors);
  return now() - start;
}

// Seconds per parallel region (fork and join) over one item per thread that does nothing, `rounds` in a row.
double fork_join_seconds(int64_t rounds) {
  std::atomic<int64_t> items{0};
  const auto start = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < rounds; ++r)
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t begin, int64_t end) { items += end - begin; });
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / rounds;
}
"""


@functools.cache
def _from_cpp() -> types.ModuleType:
    """The C++ loop over a pass's panel kernels, and the fork-and-join timer, built against the kernels' extension
    (whose symbols it resolves when loaded; needs cpu_kernels())."""
    from torch.utils.cpp_extension import load_inline

    source = builds.generated_sources()["ops.h"] + _FROM_CPP
    # NOTE: named by the source and its checkout, as the extension (extension.py): two checkouts' benches never load
    # (or rebuild over) each other's module
    digest = hashlib.sha256(f"{CSRC}\n{source}".encode()).hexdigest()[:12]
    return load_inline(f"kvforge_bench_panel_pass_{digest}", cpp_sources=[source],
                       functions=["panel_pass", "panel_pass_seconds", "fork_join_seconds"],
                       extra_cflags=["-O3", "-fopenmp"],
                       extra_ldflags=["-fopenmp"])


def _random_weight(num_rows: int, in_features: int, bits: int, group_size: int,
                   generator: torch.Generator) -> QuantizedWeight:  # fmt: skip
    codes = torch.randint(0, 2**bits, (num_rows, in_features), dtype=torch.uint8, generator=generator)
    scales = torch.rand(num_rows, in_features // group_size, generator=generator) * 0.01
    zeros = torch.full_like(scales, 2 ** (bits - 1))  # symmetric: int8pack takes these
    return QuantizedWeight(codes, scales, zeros, bits)


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class PanelCall:
    """x -> x W^T by the panel kernel."""

    def __init__(self, weight: torch.Tensor, factor: float, bits: int, num_rows: int) -> None:
        self.weight, self.factor, self.bits, self.num_rows = weight, factor, bits, num_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return panel_linear(x, self.weight, self.factor, self.bits, self.num_rows)


def _in_arena(layers: list[dict[str, tuple[Callable, int]]]) -> None:
    """Each layer's panel variants also with the weights as the engine keeps them: interleaved by thread in one
    arena in the order of the pass (interleaved_views), in 2 MiB pages where the kernel offers them; the variant
    "... arena". "... arena 4K": the same in 4 KiB pages."""
    huge = huge_pages_offered()
    for name in [name for name, (call, _) in layers[0].items() if isinstance(call, PanelCall)]:
        for suffix, in_huge_pages in ((" arena 4K", False), (" arena", True)) if huge else ((" arena", False),):
            calls = [layer[name][0] for layer in layers]
            views = interleaved_views([call.weight for call in calls], in_huge_pages)
            for layer, call, view in zip(layers, calls, views):
                moved = view.copy_(call.weight)
                layer[f"{name}{suffix}"] = (PanelCall(moved, call.factor, call.bits, call.num_rows), layer[name][1])


def _layer_calls(num_rows: int, in_features: int, group_size: int, generator: torch.Generator
                 ) -> dict[str, tuple[Callable, int]]:  # fmt: skip
    """One (x -> x W^T, bytes of the weight it reads) per variant for a random weight of this shape: 4-bit codes in
    groups of group_size, 8-bit ones with one scale per row (w8a16, which int8pack takes) and in groups (GGUF's
    Q8_0) for the C++ kernels."""
    weight = torch.randn(num_rows, in_features, generator=generator)
    int8 = _random_weight(num_rows, in_features, 8, in_features, generator)
    int4 = _random_weight(num_rows, in_features, 4, group_size, generator)
    grouped8 = _random_weight(num_rows, in_features, 8, group_size, generator)
    calls: dict[str, tuple[Callable, int]] = {"fp32": (lambda x: F.linear(x, weight), _bytes(weight))}
    if native_kernels_available():
        calls["dense"] = (lambda x: torch.ops.kvforge_cpu.dense_gemv(x, weight), _bytes(weight))
        if ONEDNN:
            calls["onednn"] = (lambda x: torch.ops.kvforge_cpu.onednn_linear(x, weight, None), _bytes(weight))
            packed_weight = pack_for_onednn(weight)
            calls["onednn packed"] = (lambda x: torch.ops.kvforge_cpu.onednn_linear(x, packed_weight, None),
                                      _bytes(weight))
        for bits, quantized in ((8, grouped8), (4, int4)):
            packed = pack_weight(quantized.codes, quantized.scales, quantized.zeros, bits)
            for suffix, int8_x in (("", False), (" q8x", True)):
                calls[f"native w{bits}{suffix}"] = (
                    lambda x, p=packed, b=bits, q=int8_x: quant_linear_cpu(x, *p, b, q), _bytes(*packed))
    if panels_available():
        for bits, quantized in ((8, grouped8), (4, int4)):
            panels, factor = pack_panels(quantized.codes, quantized.scales, quantized.zeros, bits)
            # NOTE: the weight rides on the call, for _in_arena
            calls[f"panels w{bits}"] = (PanelCall(panels, factor, bits, num_rows), _bytes(panels))
    if packed_gemm.int8pack_eligible(int8):
        packed8 = packed_gemm.prepack_int8(int8)
        calls["int8pack"] = (lambda x: packed_gemm.int8pack_linear(x, *packed8), _bytes(*packed8))
    if packed_gemm.int4pack_eligible(int4):
        packed4 = packed_gemm.prepack_int4(int4)
        calls["int4pack"] = (lambda x: packed_gemm.int4pack_linear(x, *packed4, group_size), _bytes(*packed4))
    return calls


class _SelfTimed:
    """A program that times itself: calling it returns its seconds (the bench's clock, read inside it)."""

    def __init__(self, run: Callable[[], float]) -> None:
        self.run = run

    def __call__(self) -> float:
        return self.run()


def _rounds(programs: dict[str, Callable[[], object]], rounds: int, clock: Callable[[], float]
            ) -> dict[str, list[float]]:
    """Each program's seconds in each round; programs take turns within a round."""
    seconds: dict[str, list[float]] = {name: [] for name in programs}
    for _ in range(rounds):
        for name, program in programs.items():
            start = clock()
            took = program()
            seconds[name].append(took if isinstance(program, _SelfTimed) else clock() - start)
    return seconds


def _fastest(programs: dict[str, Callable[[], object]], rounds: int, clock: Callable[[], float]) -> dict[str, float]:
    return {name: min(seconds) for name, seconds in _rounds(programs, rounds, clock).items()}


def _print_row(label: str, times: dict[str, float], scale: float, unit: str) -> None:
    baseline = times["fp32"]
    cells = [f"{name} {t * scale:8.1f} {unit} ({baseline / t:4.2f}x)" for name, t in times.items()]
    print(f"{label:<22}" + "  ".join(cells), flush=True)


COPY_BYTES = 1 << 30


def _streamed(label: str, shapes: list[tuple[int, int]], args: argparse.Namespace, clock: Callable[[], float],
              generator: torch.Generator) -> None:  # fmt: skip
    """One pass over a weight per shape, in turn, per row of the table (one per token count), and the GB/s of
    each variant against a copy timed in the same rounds."""
    layers = [_layer_calls(n, k, args.group_size, generator) for n, k in shapes]
    if len(layers) > 1:
        _in_arena(layers)
    weight_bytes = {name: sum(calls[name][1] for calls in layers) for name in layers[0]}
    source = torch.empty(COPY_BYTES, dtype=torch.uint8).fill_(1)
    target = torch.empty_like(source)
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        inputs = {k: torch.randn(num_tokens, k, generator=generator) for _, k in shapes}
        inputs_per_layer = [inputs[k] for _, k in shapes]
        programs = {
            name: (lambda name=name, xs=inputs_per_layer: [calls[name][0](x) for calls, x in zip(layers, xs)])
            for name in layers[0]
        }
        callers = (("compiled", _compiled_pass, args.compiled), ("from C++", _cpp_pass, args.from_cpp))
        for caller, make in [(caller, make) for caller, make, wanted in callers if wanted]:
            for name in [name for name in layers[0] if name.endswith("arena")]:
                programs[f"{name} {caller}"] = make([calls[name][0] for calls in layers], inputs_per_layer)
                weight_bytes[f"{name} {caller}"] = weight_bytes[name]
        programs["copy"] = lambda: target.copy_(source)
        seconds = _rounds(programs, max(3, args.rounds // 3), clock)
        copies = seconds.pop("copy")
        times = {name: min(took) for name, took in seconds.items()}
        copy_gbs = 2 * COPY_BYTES / min(copies) / 1e9
        _print_row(f"{label} M={num_tokens}", times, 1e3, "ms")
        cells = [f"{name} {weight_bytes[name] / t / 1e9:5.1f} GB/s ({weight_bytes[name] / t / 1e9 / copy_gbs:4.0%})"
                 for name, t in times.items()]
        print(f"{'  reads, copy ' + f'{copy_gbs:.1f}':<22}" + "  ".join(cells), flush=True)
        # NOTE: the fastest rounds of the copy and of a variant can fall in different minutes of a VM whose memory
        # speed moves from one minute to the next; each round's read rate against the copy of the same round,
        # seconds apart, and the median of those ratios, is the steadier comparison.
        ratios = {name: statistics.median(weight_bytes[name] * copy / (2 * COPY_BYTES * t)
                                          for t, copy in zip(took, copies))
                  for name, took in seconds.items()}
        print(f"{'  per round, median':<22}" + "  ".join(f"{name} {r:4.0%}" for name, r in ratios.items()), flush=True)


def _compiled_pass(calls: list[Callable], inputs: list[torch.Tensor]) -> Callable[[], object]:
    """The pass as one graph compiled and replayed the way the engine compiles and replays a decode step of len(x)
    rows (DecodeGraphs: Inductor, its C++ wrapper up to CPP_WRAPPER_MAX_BATCH rows, the graph then called on its
    inputs directly, without dynamo's guards), so the kernels are called as the engine's compiled step calls them."""
    from torch._inductor.compile_fx import compile_fx

    def run(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [call(x) for call, x in zip(calls, xs)]

    built = []

    def inductor(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable:
        built.append((compile_fx(graph, example_inputs), list(example_inputs)))
        return built[-1][0]

    cpp_wrapper = inputs[0].shape[0] <= CPP_WRAPPER_MAX_BATCH
    # NOTE: a code object of its own, or torch.compile would share (and recompile) one cache across variants
    run = types.FunctionType(run.__code__.replace(), globals(), "run", None, run.__closure__)
    with torch._inductor.config.patch(inductor_options(inputs[0].device, cpp_wrapper)):
        torch.compile(run, fullgraph=True, dynamic=False, backend=inductor)(inputs)
    graph, graph_inputs = built[0]
    return lambda: graph(*graph_inputs)


def _cpp_pass(calls: list[PanelCall], inputs: list[torch.Tensor]) -> _SelfTimed:
    """The pass's panel calls, made from one C++ loop that times itself (checked once against the same calls from
    Python); CPU time of the calling thread with one thread, as main's clock."""
    pass_args = (inputs, [call.weight for call in calls], calls[0].bits, [call.num_rows for call in calls],
                 [call.factor for call in calls])
    if not all(torch.equal(a, call(x)) for a, call, x in zip(_from_cpp().panel_pass(*pass_args), calls, inputs)):
        raise AssertionError("the C++ loop's results differ from the kernel's called from Python")
    cpu_time = torch.get_num_threads() == 1
    return _SelfTimed(lambda: _from_cpp().panel_pass_seconds(*pass_args, cpu_time))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", default="1,4,16", help="rows of x (decoding sequences), comma-separated")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--group-size", type=int, default=32, help="of the grouped weights (default: GGUF's 32)")
    parser.add_argument("--compiled", action="store_true",
                        help="also time the panel kernels' model pass compiled as the engine compiles a decode step")
    parser.add_argument("--from-cpp", action="store_true",
                        help="also time the panel kernels' model pass called from a C++ loop, and a fork and join")
    args = parser.parse_args()
    if args.from_cpp and cpu_kernels() is None:
        parser.error("--from-cpp needs the C++ CPU kernels, which are not built on this machine")
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    generator = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} thread(s), CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; times are the fastest of {args.rounds} rounds")
    if args.from_cpp:
        seconds = min(_from_cpp().fork_join_seconds(20000) for _ in range(5))
        print(f"a parallel region doing nothing (a fork and join of {args.threads} threads): {seconds * 1e6:.2f} us")
    with torch.inference_mode():
        print("\neach shape alone (weights in cache), per call:")
        for num_rows, in_features in SHAPES:
            calls = _layer_calls(num_rows, in_features, args.group_size, generator)
            for num_tokens in (int(t) for t in args.tokens.split(",")):
                x = torch.randn(num_tokens, in_features, generator=generator)
                programs = {name: (lambda c=call, x=x: [c(x) for _ in range(20)]) for name, (call, _) in calls.items()}
                times = _fastest(programs, args.rounds, clock)
                _print_row(f"{num_rows}x{in_features} M={num_tokens}", times, 1e6 / 20, "us")
        print(f"\n{NUM_LAYERS} layers of the 4 shapes (weights streamed from memory), per pass:")
        _streamed("model", [shape for _ in range(NUM_LAYERS) for shape in SHAPES], args, clock, generator)
        print(f"\nthe LM head, {LM_HEAD[0]}x{LM_HEAD[1]} (streamed; the default model's is 8-bit), per call:")
        _streamed("lm_head", [LM_HEAD], args, clock, generator)


if __name__ == "__main__":
    main()
