"""One PNG: the op classes on the roofline, and each step's time as stacked bars over batch size,
decode and prefill apart (needs matplotlib; without it the other reports are still written)."""

from __future__ import annotations

from pathlib import Path

from kvforge.profiler.report import Profile
from kvforge.profiler.timeline import StepProfile

# Bar segments: op classes grouped so that a dozen colours tell them apart.
GROUPS = {
    "GEMMs": ("gemm.qkv", "gemm.o", "gemm.mlp", "gemm.compiled"),
    "LM head": ("gemm.lm_head",),
    "attention": ("attention.prefill", "attention.decode"),
    "cache write": ("cache_write",),
    "norm/rotary/act": ("norm", "rotary", "activation", "embedding"),
    "MoE": ("moe.routing", "moe.experts"),
    "fused (compiled)": ("fused",),
    "model Python": ("model.python",),
    "model other": ("model.other",),
    "communication": ("communication",),
    "pipeline wait": ("pipeline_wait",),
    "host": ("host.schedule", "host.prepare", "host.sample", "host.detokenize", "host.update", "host.outputs",
             "host.other"),
}
_MAX_BARS = 12


def _bins(values: list[int]) -> list[tuple[int, int]]:
    """[lo, hi] ranges of batch sizes: each distinct value, or powers of two when there are too many."""
    distinct = sorted(set(values))
    if len(distinct) <= _MAX_BARS:
        return [(v, v) for v in distinct]
    bins, lo = [], 1
    while lo <= distinct[-1]:
        bins.append((lo, 2 * lo - 1))
        lo *= 2
    return [b for b in bins if any(b[0] <= v <= b[1] for v in distinct)]


def _bars(ax, steps: list[StepProfile], size_of, xlabel: str, title: str) -> None:
    bins = _bins([size_of(s) for s in steps])
    bottoms = [0.0] * len(bins)
    labels = [str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in bins]
    for group, classes in GROUPS.items():
        heights = []
        for lo, hi in bins:
            inside = [s for s in steps if lo <= size_of(s) <= hi]
            heights.append(sum(s.seconds.get(c, 0.0) for s in inside for c in classes) / len(inside) * 1e3)
        if any(heights):
            ax.bar(labels, heights, bottom=bottoms, label=group)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_xlabel(xlabel)
    ax.set_ylabel("ms per step")
    ax.set_title(title)
    ax.tick_params(axis="x", labelrotation=45)


def _roofline(ax, profile: Profile) -> None:
    peaks = profile.peaks
    peak_gflops, bandwidth = peaks.tflops * 1e3, peaks.bandwidth_gbs
    xs = [2.0**e for e in range(-6, 13)]
    ax.loglog(xs, [min(peak_gflops, bandwidth * x) for x in xs], "k-", label="roof")
    markers = {"decode": "o", "decode (compiled)": "D", "prefill": "^", "mixed": "s"}
    for kind, summary in profile.summaries.get(0, {}).items():
        for v in summary.verdicts:
            if v.flops > 0 and v.bytes > 0 and v.seconds > 0:
                ax.loglog(v.intensity, v.gflops_per_s, markers[kind], color="C0" if kind.startswith("decode") else "C3")
                ax.annotate(f"{v.label} ({kind[0]})", (v.intensity, v.gflops_per_s), fontsize=6)
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("achieved GFLOP/s")
    ax.set_title(f"roofline: {bandwidth:.0f} GB/s, {peak_gflops:.0f} GFLOP/s ({peaks.source})")


def write_png(profile: Profile, path: Path) -> bool:
    """Write the picture; False when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s for s in profile.ranks.get(0, []) if not s.compiling]  # a compiling step times the compiler
    decode = [s for s in steps if s.kind == "decode"]
    prefill = [s for s in steps if s.kind in ("prefill", "mixed")]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    _roofline(axes[0], profile)
    if decode:
        _bars(axes[1], decode, lambda s: s.num_seqs, "sequences in the step", "decode steps")
    if prefill:
        _bars(axes[2], prefill, lambda s: s.num_tokens, "tokens in the step", "prefill (and mixed) steps")
    handles, labels = (axes[1] if decode else axes[2]).get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=8)
    fig.suptitle(f"{profile.model} on {profile.device}", y=0.02, fontsize=9)
    fig.tight_layout(rect=(0, 0.03, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
