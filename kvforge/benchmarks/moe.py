"""`kvforge bench moe`: the routed-experts computation of one MoE layer on the CPU, per implementation.

Implementations, all with one contract (kvforge/kernels/fused_moe.py):

    loop          the reference: a Python loop over every expert, gathering its tokens (fused_moe_ref)
    fused         the CPU path: pairs sorted by expert, two grouped matmuls (fused_moe_cpu)
    sorted-slices pairs sorted by expert, one matmul pair per expert that got tokens (a candidate)
    gather-bmm    each pair's expert weights gathered, one batched matmul (a candidate)
    kept-q8, kept-q4  each expert's weights quantized (round to nearest, 8 or 4 bits, groups of 32: as a GGUF file's
                  Q8_0 and Q4_0 experts kept) on the weight-only kernels, per expert (fused_moe_per_expert, as a
                  GGUF MoE runs on the CPU); checked against the float loop within their rounding

Each is timed (median of --iters runs after one warm-up) at every token count of --tokens, on three
layer shapes in fp32: Mixtral-like (8 experts, top-2), DeepSeek-V2-like (64 small experts, top-6) and
DeepSeek-V3-like (256 smaller experts, top-8).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvforge.kernels.activation import silu_and_mul_ref
from kvforge.kernels.fused_moe import fused_moe_cpu, fused_moe_per_expert, fused_moe_ref
from kvforge.kernels.ops import current_ops
from kvforge.quantization.quantized_weight import quantize_rtn
from kvforge.quantization.weight_only_kernels import select_kernel


@dataclass(frozen=True, slots=True)
class LayerShape:
    name: str
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int


FULL = (
    LayerShape("mixtral-like", 8, 2, 1024, 3584),
    LayerShape("deepseek-like", 64, 6, 1024, 512),
    LayerShape("deepseek-v3-like", 256, 8, 1024, 256),
)
QUICK = (LayerShape("quick", 8, 2, 64, 32),)


def sorted_slices(hidden, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """Candidate: the pairs sorted by expert, one pair of matmuls per expert that got tokens."""
    top_k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1)
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=w13.shape[0]).tolist()
    tokens = order // top_k
    x = hidden[tokens]
    down = torch.empty_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = slice(start, start + count)
            down[rows] = F.linear(silu_and_mul_ref(F.linear(x[rows], w13[expert])), w2[expert])
            start += count
    down *= topk_weights.reshape(-1)[order, None]
    return torch.zeros_like(hidden).index_add_(0, tokens, down)


def gather_bmm(hidden, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """Candidate: every pair's expert weights gathered ([pairs, 2I, H]), one batched matmul each."""
    top_k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1)
    x = hidden.repeat_interleave(top_k, dim=0)
    gate_up = torch.bmm(w13[ids], x[:, :, None]).squeeze(-1)
    down = torch.bmm(w2[ids], silu_and_mul_ref(gate_up)[:, :, None]).squeeze(-1)
    return (down * topk_weights.reshape(-1, 1)).view(hidden.shape[0], top_k, -1).sum(1)


def kept(bits: int) -> Callable[..., torch.Tensor]:
    """The experts quantized to `bits` (symmetric, groups of 32) on the weight-only kernels, each its own multiply."""
    cache: dict[int, tuple[list, list]] = {}  # id(w13) -> the experts' kernels (prepared once per layer shape)

    def run(hidden, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
        if id(w13) not in cache:
            cache.clear()
            ops = current_ops()
            cache[id(w13)] = tuple([select_kernel(quantize_rtn(w, bits, 32, sym=True), w.device, w.dtype, ops).apply
                                    for w in weights] for weights in (w13, w2))  # fmt: skip
        gate_up, down = cache[id(w13)]
        return fused_moe_per_expert(hidden, topk_weights, topk_ids, gate_up, down)

    return run


IMPLEMENTATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "loop": fused_moe_ref,
    "fused": fused_moe_cpu,
    "sorted-slices": sorted_slices,
    "gather-bmm": gather_bmm,
    "kept-q8": kept(8),
    "kept-q4": kept(4),
}
TOLERANCE = {"kept-q8": 3e-2, "kept-q4": 2e-1}  # of the largest output: the weights' and inputs' rounding
GATHER_BMM_MAX_BYTES = 1024**3  # gather-bmm copies pairs x expert weights: skipped past this


@dataclass(frozen=True, slots=True)
class Row:
    layer: str
    num_tokens: int
    implementation: str
    ms: float
    speedup_vs_loop: float


def _median_ms(fn: Callable[[], torch.Tensor], iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def bench_layer(shape: LayerShape, token_counts: list[int], iters: int) -> list[Row]:
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(shape.num_experts, 2 * shape.intermediate, shape.hidden, generator=gen) / shape.hidden**0.5
    w2 = torch.randn(shape.num_experts, shape.hidden, shape.intermediate, generator=gen) / shape.intermediate**0.5
    rows = []
    for num_tokens in token_counts:
        hidden = torch.randn(num_tokens, shape.hidden, generator=gen)
        logits = torch.randn(num_tokens, shape.num_experts, generator=gen)
        topk_weights, topk_ids = logits.softmax(-1).topk(shape.top_k, dim=-1)
        args = (hidden, w13, w2, topk_weights, topk_ids)
        expected = fused_moe_ref(*args)
        timings = {}
        for name, fn in IMPLEMENTATIONS.items():
            gathered_bytes = num_tokens * shape.top_k * 3 * shape.hidden * shape.intermediate * 4
            if name == "gather-bmm" and gathered_bytes > GATHER_BMM_MAX_BYTES:
                continue
            if name in TOLERANCE:
                error = (fn(*args) - expected).abs().max() / expected.abs().max()
                assert error <= TOLERANCE[name], f"{name}: {error:.3g} of the largest output"
            else:
                torch.testing.assert_close(fn(*args), expected, atol=1e-3, rtol=1e-3)
            timings[name] = _median_ms(lambda fn=fn, args=args: fn(*args), iters)
        rows += [Row(shape.name, num_tokens, name, ms, timings["loop"] / ms) for name, ms in timings.items()]
    return rows


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]  # fmt: skip
        cpu = names[0] if names else cpu
    return f"{cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def markdown(rows: list[Row]) -> str:
    lines = ["| layer | tokens | implementation | ms | vs loop |", "|---|---:|---|---:|---:|"]
    lines += [f"| {r.layer} | {r.num_tokens} | {r.implementation} | {r.ms:.2f} | {r.speedup_vs_loop:.2f}x |"
              for r in rows]  # fmt: skip
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", default="1,16,256", help="comma-separated token counts")
    parser.add_argument("--iters", type=int, default=10, help="timed runs per case (median reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="a tiny layer (smoke test)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")


def run(args: argparse.Namespace) -> int:
    token_counts = [int(t) for t in args.tokens.split(",") if t.strip()]
    if not token_counts or min(token_counts) < 1:
        raise ValueError(f"--tokens must be positive integers, got {args.tokens!r}")
    if args.iters < 1:
        raise ValueError(f"--iters must be >= 1, got {args.iters}")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    rows = [row for shape in (QUICK if args.quick else FULL) for row in bench_layer(shape, token_counts, args.iters)]
    print(f"MoE layer on the CPU ({machine()})")
    print(markdown(rows))
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": machine(), "rows": [asdict(r) for r in rows]}, indent=2))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
