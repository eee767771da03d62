"""`kvforge bench kernels`: each op's implementation against its baseline, placed on the roofline.

Attention is compared with torch's scaled_dot_product_attention on contiguous K/V, the other ops with
their torch references. Each row reports time, TFLOP/s, GB/s and the fraction of the roofline, i.e.
max(flops / peak_flops, bytes / peak_bandwidth) / time, with datasheet peaks of the platform when it is
a known device and otherwise peaks measured here (a large matmul and a large copy).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvforge.kernels import ops
from kvforge.kernels.ops import TORCH_OPS, TRITON_OPS
from kvforge.platforms import Platform, current_platform, select_backend

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
KERNELS = (
    "prefill",
    "decode",
    "rms_norm",
    "fused_add_rms_norm",
    "rotary",
    "silu_and_mul",
    "reshape_and_cache",
)


@dataclass(frozen=True, slots=True)
class Shapes:
    """The problem sizes of one benchmark run."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    prefill: tuple[tuple[int, int], ...]  # (batch, seq_len)
    decode: tuple[tuple[int, int], ...]  # (batch, context_len)
    num_tokens: int  # for the per-token ops
    hidden: int
    intermediate: int


FULL = Shapes(
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    prefill=((1, 1024), (1, 4096), (1, 16384), (4, 4096), (16, 1024)),
    decode=tuple((b, c) for b in (1, 8, 64, 256) for c in (512, 4096, 32768) if b * c <= 1 << 21),
    num_tokens=4096,
    hidden=8192,
    intermediate=14336,
)
QUICK = Shapes(
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    prefill=((1, 48),),
    decode=((2, 40),),
    num_tokens=8,
    hidden=256,
    intermediate=128,
)
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class Peaks:
    bandwidth_gbs: float
    tflops: float
    source: str  # "datasheet" or "measured"


@dataclass(frozen=True, slots=True)
class Prepared:
    """One benchmark case with its inputs built: the two callables and the work they do."""

    run: Callable[[], object]
    baseline: Callable[[], object]
    flops: float
    bytes: float


@dataclass(frozen=True, slots=True)
class Row:
    kernel: str
    shape: str
    impl: str  # the backend name, or "baseline"
    ms: float
    tflops: float
    gbs: float
    roofline_fraction: float


def _time_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Mean time of one call. On a GPU: CUDA events around each call, L2 flushed before each."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1e3 / iters
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)
    ]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return sum(start.elapsed_time(end) for start, end in events) / iters


def measure_peaks(device: torch.device, dtype: torch.dtype, quick: bool, matmul_n: int | None = None,
                  copy_mib: int | None = None) -> Peaks:
    """Achieved peaks here: a square matmul (n = matmul_n) and a device-to-device copy (copy_mib MiB)."""
    n = matmul_n or (512 if quick else 8192)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    matmul_ms = _time_ms(lambda: a @ b, device, warmup=2, iters=3 if quick else 20)
    numel = (copy_mib or (16 if quick else 1024)) << 20
    src, dst = (
        torch.empty(numel, dtype=torch.uint8, device=device),
        torch.empty(numel, dtype=torch.uint8, device=device),
    )
    copy_ms = _time_ms(lambda: dst.copy_(src), device, warmup=2, iters=3 if quick else 20)
    return Peaks(
        bandwidth_gbs=2 * numel / copy_ms / 1e6, tflops=2 * n**3 / matmul_ms / 1e9, source="measured"
    )


def datasheet_peaks(platform: Platform, dtype: torch.dtype) -> Peaks | None:
    if platform.peak is None:
        return None
    tflops = platform.peak.fp32_tflops if dtype == torch.float32 else platform.peak.bf16_tflops
    return Peaks(platform.peak.memory_bandwidth_gbs, tflops, "datasheet")


def _paged_inputs(
    seq_lens: list[int], q_lens: list[int], s: Shapes, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """query, key_cache, value_cache, block_tables, query_start_loc, seq_lens for a ragged batch."""
    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    cache_shape = (1 + sum(blocks), BLOCK_SIZE, s.num_kv_heads, s.head_dim)
    key_cache = torch.randn(cache_shape, device=device, dtype=dtype)
    value_cache = torch.randn(cache_shape, device=device, dtype=dtype)
    block_ids = (torch.randperm(sum(blocks), device=device) + 1).int()
    block_tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=device)
    first_block = torch.tensor([0, *blocks]).cumsum(0).tolist()
    for seq, count in enumerate(blocks):
        block_tables[seq, :count] = block_ids[first_block[seq] : first_block[seq] + count]
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    query = torch.randn(sum(q_lens), s.num_heads, s.head_dim, device=device, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return query, key_cache, value_cache, block_tables, starts, lens


def _sdpa(q_len: int, ctx: int, batch: int, s: Shapes, dtype: torch.dtype, device: torch.device) -> Callable:
    q = torch.randn(batch, s.num_heads, q_len, s.head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, s.num_kv_heads, ctx, s.head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=q_len > 1, enable_gqa=True)


def _attention_case(
    batch: int, q_len: int, ctx: int, impl: ops.OpTable, s: Shapes, dtype: torch.dtype, device: torch.device
) -> Prepared:
    args = _paged_inputs([ctx] * batch, [q_len] * batch, s, dtype, device)
    scale = s.head_dim**-0.5
    pairs = q_len * (ctx - q_len) + q_len * (q_len + 1) / 2  # (query, key) pairs per sequence and head
    size = dtype.itemsize
    moved = batch * (2 * q_len * s.num_heads + 2 * ctx * s.num_kv_heads) * s.head_dim * size
    return Prepared(
        run=lambda: impl.paged_attention(*args, scale),
        baseline=_sdpa(q_len, ctx, batch, s, dtype, device),
        flops=4 * batch * s.num_heads * s.head_dim * pairs,
        bytes=moved,
    )


OpCall = Callable[[ops.OpTable], object]


def _norm_case(
    kernel: str, s: Shapes, dtype: torch.dtype, device: torch.device
) -> tuple[OpCall, float, float]:
    """(call, flops, bytes) of rms_norm or fused_add_rms_norm."""
    x, residual = (torch.randn(s.num_tokens, s.hidden, device=device, dtype=dtype) for _ in range(2))
    weight = torch.randn(s.hidden, device=device, dtype=dtype)
    elems = s.num_tokens * s.hidden
    if kernel == "rms_norm":
        return lambda o: o.rms_norm(x, weight, 1e-6), 4 * elems, 2 * elems * dtype.itemsize
    return lambda o: o.fused_add_rms_norm(x, residual, weight, 1e-6), 5 * elems, 4 * elems * dtype.itemsize


def _rotary_case(s: Shapes, dtype: torch.dtype, device: torch.device) -> tuple[OpCall, float, float]:
    q = torch.randn(s.num_tokens, s.num_heads, s.head_dim, device=device, dtype=dtype)
    k = torch.randn(s.num_tokens, s.num_kv_heads, s.head_dim, device=device, dtype=dtype)
    positions = torch.randint(0, 4096, (s.num_tokens,), device=device)
    cos_sin = torch.randn(4096, s.head_dim, device=device)
    elems = s.num_tokens * (s.num_heads + s.num_kv_heads) * s.head_dim
    moved = 2 * elems * dtype.itemsize + s.num_tokens * s.head_dim * 4
    return lambda o: o.rotary_embedding(positions, q, k, cos_sin, True), 3 * elems, moved


def _silu_case(s: Shapes, dtype: torch.dtype, device: torch.device) -> tuple[OpCall, float, float]:
    x = torch.randn(s.num_tokens, 2 * s.intermediate, device=device, dtype=dtype)
    elems = s.num_tokens * s.intermediate
    return lambda o: o.silu_and_mul(x), 6 * elems, 3 * elems * dtype.itemsize


def _cache_write_case(s: Shapes, dtype: torch.dtype, device: torch.device) -> tuple[OpCall, float, float]:
    key, value = (
        torch.randn(s.num_tokens, s.num_kv_heads, s.head_dim, device=device, dtype=dtype) for _ in range(2)
    )
    num_blocks = 2 * s.num_tokens // BLOCK_SIZE
    key_cache, value_cache = (
        torch.randn(num_blocks, BLOCK_SIZE, s.num_kv_heads, s.head_dim, device=device, dtype=dtype)
        for _ in range(2)
    )
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device)[: s.num_tokens]
    moved = 4 * key.numel() * dtype.itemsize
    return lambda o: o.reshape_and_cache(key, value, key_cache, value_cache, slots), 0.0, moved


def _row_op_case(
    kernel: str, impl: ops.OpTable, s: Shapes, dtype: torch.dtype, device: torch.device
) -> Prepared:
    """A per-token op, timed against its torch reference."""
    if kernel in ("rms_norm", "fused_add_rms_norm"):
        call, flops, moved = _norm_case(kernel, s, dtype, device)
    elif kernel == "rotary":
        call, flops, moved = _rotary_case(s, dtype, device)
    elif kernel == "silu_and_mul":
        call, flops, moved = _silu_case(s, dtype, device)
    else:
        call, flops, moved = _cache_write_case(s, dtype, device)
    return Prepared(run=lambda: call(impl), baseline=lambda: call(TORCH_OPS), flops=flops, bytes=moved)


def _cases(
    kernels: list[str], impl: ops.OpTable, s: Shapes, dtype: torch.dtype, device: torch.device
) -> list[tuple[str, str, Callable[[], Prepared]]]:
    """(kernel, shape label, builder) for every selected case; inputs are built one case at a time."""
    cases = []
    for kernel in kernels:
        if kernel == "prefill":
            cases += [
                (kernel, f"b{b} s{n}", lambda b=b, n=n: _attention_case(b, n, n, impl, s, dtype, device))
                for b, n in s.prefill
            ]
        elif kernel == "decode":
            cases += [
                (kernel, f"b{b} ctx{c}", lambda b=b, c=c: _attention_case(b, 1, c, impl, s, dtype, device))
                for b, c in s.decode
            ]
        else:
            cases.append(
                (kernel, f"t{s.num_tokens}", lambda k=kernel: _row_op_case(k, impl, s, dtype, device))
            )
    return cases


def _row(kernel: str, shape: str, impl: str, ms: float, case: Prepared, peaks: Peaks) -> Row:
    ideal_ms = max(case.flops / (peaks.tflops * 1e9), case.bytes / (peaks.bandwidth_gbs * 1e6))
    return Row(kernel, shape, impl, ms, case.flops / ms / 1e9, case.bytes / ms / 1e6, ideal_ms / ms)


def _format_table(rows: list[Row]) -> str:
    header = f"{'kernel':<20}{'shape':<14}{'impl':<10}{'ms':>10}{'TFLOP/s':>10}{'GB/s':>10}{'roofline':>10}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.kernel:<20}{r.shape:<14}{r.impl:<10}{r.ms:>10.4f}{r.tflops:>10.2f}{r.gbs:>10.1f}"
            f"{r.roofline_fraction:>10.1%}"
        )
    return "\n".join(lines)


def _plot(rows: list[Row], path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys((r.kernel, r.shape) for r in rows))  # in run order
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(labels) + 1.5))
    for offset, impl in enumerate(dict.fromkeys(r.impl for r in rows)):
        values = {(r.kernel, r.shape): r.roofline_fraction for r in rows if r.impl == impl}
        ax.barh(
            [i + 0.4 * offset for i in range(len(labels))],
            [values.get(k, 0.0) for k in labels],
            height=0.4,
            label=impl,
        )
    ax.set_yticks([i + 0.2 for i in range(len(labels))], [f"{k} {s}" for k, s in labels])
    ax.invert_yaxis()  # first case on top
    ax.set_xlabel("fraction of roofline")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few iterations (smoke test)")
    parser.add_argument("--out", type=Path, default=None, help="write kernels.json (and kernels.png) here")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated subset of {KERNELS}")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on GPU, fp32 on CPU"
    )
    parser.add_argument(
        "--backend",
        choices=("auto", "torch", "triton"),
        default="auto",
        help="implementation to time against the baseline (auto: the platform's choice)",
    )
    parser.add_argument("--iters", type=int, default=None, help="timed calls per case (default 20, quick 2)")


def run(args: argparse.Namespace) -> int:
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = sorted(set(kernels) - set(KERNELS))
    if unknown:
        raise ValueError(f"unknown kernels {unknown}; choose from {KERNELS}")
    platform = current_platform()
    device = torch.device(platform.device_type)
    dtype = DTYPES[args.dtype or ("bf16" if platform.is_gpu else "fp32")]
    backend = select_backend(args.backend)
    impl = TRITON_OPS if backend == "triton" else TORCH_OPS
    iters = args.iters or (2 if args.quick else 20)
    if iters < 1:
        raise ValueError(f"--iters must be >= 1, got {iters}")
    measured = measure_peaks(device, dtype, args.quick)
    peaks = datasheet_peaks(platform, dtype) or measured
    rows = []
    for kernel, shape, build in _cases(kernels, impl, QUICK if args.quick else FULL, dtype, device):
        case = build()
        for name, fn in ((backend, case.run), ("baseline", case.baseline)):
            rows.append(
                _row(
                    kernel,
                    shape,
                    name,
                    _time_ms(fn, device, warmup=1 if args.quick else 3, iters=iters),
                    case,
                    peaks,
                )
            )
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(
        f"{platform.device_name} ({platform.arch}), {dtype}, peaks: {peaks.bandwidth_gbs:.0f} GB/s, "
        f"{peaks.tflops:.3g} TFLOP/s ({peaks.source})"
    )
    print(_format_table(rows))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {
            "platform": asdict(platform),
            "dtype": str(dtype),
            "backend": backend,
            "peaks": asdict(peaks),
            "measured_peaks": asdict(measured),
            "rows": [asdict(r) for r in rows],
        }
        (args.out / "kernels.json").write_text(json.dumps(report, indent=2))
        _plot(rows, args.out / "kernels.png")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
