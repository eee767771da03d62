"""The profile as people read it: a table per rank and step kind, and the same as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvforge.benchmarks.kernels import Peaks
from kvforge.profiler.op_classes import HOST_CLASSES, MODEL_CLASSES
from kvforge.profiler.roofline import OVERHEAD_FRACTION, StepSummary, summarize
from kvforge.profiler.timeline import StepProfile

KINDS = ("decode", "decode (compiled)", "prefill", "mixed")


def summary_kind(step: StepProfile) -> str:
    """Compiled and eager decode steps are summarized apart (their op classes differ)."""
    return f"{step.kind} (compiled)" if step.compiled and step.kind == "decode" else step.kind


@dataclass(slots=True)
class Profile:
    """Everything one `kvforge profile` run found: per rank, its steps and their summaries per kind."""

    model: str
    device: str
    dtype: str
    peaks: Peaks
    attribution: str  # how op times were attributed (ranges in eager mode, or kernel names when compiled)
    ranks: dict[int, list[StepProfile]]
    summaries: dict[int, dict[str, StepSummary]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for rank, steps in self.ranks.items():
            measured = [s for s in steps if not s.compiling]
            self.summaries[rank] = {kind: summarize(kind, [s for s in measured if summary_kind(s) == kind], self.peaks)
                                    for kind in KINDS if any(summary_kind(s) == kind for s in measured)}


def coverage(steps: list[StepProfile]) -> tuple[float, float]:
    """(share of model time the named op classes explain, share of step time named host parts + model
    time explain): the rest is model.other and host.other."""
    wall = sum(s.wall_s for s in steps)
    model = sum(s.model_s for s in steps)
    model_other = sum(s.seconds.get("model.other", 0.0) for s in steps)
    host_other = sum(s.seconds.get("host.other", 0.0) for s in steps)
    return ((model - model_other) / model if model else 0.0, (wall - host_other) / wall if wall else 0.0)


def _kind_table(summary: StepSummary) -> list[str]:
    s = summary
    lines = [f"{s.kind} steps: {s.num_steps}, {s.mean_seqs:.1f} sequences each; per step {s.wall_s * 1e3:.2f} ms = "
             f"model {s.model_s * 1e3:.2f} ms + host {s.host_s * 1e3:.2f} ms; ideal {s.ideal_s * 1e3:.2f} ms; "
             f"bound: {s.bound}"]
    header = f"  {'op class':<18}{'ms/step':>9}{'share':>7}{'GFLOP/s':>10}{'GB/s':>9}{'roof':>7}  bound"
    lines += [header, "  " + "-" * (len(header) - 2)]
    for v in sorted(s.verdicts, key=lambda v: -v.seconds):
        roof = f"{v.roof_fraction:>6.0%}" if v.bound in ("compute", "memory") or v.flops or v.bytes else f"{'-':>6}"
        lines.append(f"  {v.label:<18}{v.seconds * 1e3:>9.3f}{v.seconds / s.wall_s:>7.1%}{v.gflops_per_s:>10.1f}"
                     f"{v.gbytes_per_s:>9.2f} {roof}  {v.bound}")
    return lines


def format_table(profile: Profile) -> str:
    p = profile
    lines = [f"kvforge profile: {p.model} on {p.device} ({p.dtype}); peaks {p.peaks.bandwidth_gbs:.1f} GB/s, "
             f"{p.peaks.tflops * 1e3:.1f} GFLOP/s ({p.peaks.source}); op times by {p.attribution}",
             f"roof = ideal time at the peaks / measured; overhead: under {OVERHEAD_FRACTION:.0%} of the roof, "
             f"or host time"]
    for rank, steps in p.ranks.items():
        model_cover, step_cover = coverage(steps)
        lines.append("")
        lines.append(f"rank {rank}: {len(steps)} steps; op classes explain {model_cover:.1%} of model time, "
                     f"host parts + model {step_cover:.1%} of step time")
        for summary in p.summaries[rank].values():
            lines += _kind_table(summary)
    if len(p.ranks) > 1:
        lines += ["", "per rank (mean per step of the whole run):",
                  f"  {'rank':<6}{'steps':>6}{'wall ms':>9}{'model ms':>10}{'comm ms':>9}{'pipeline wait ms':>18}"]
        for rank, steps in p.ranks.items():
            n = max(1, len(steps))
            comm = sum(s.seconds.get("communication", 0.0) for s in steps) / n
            wait = sum(s.seconds.get("pipeline_wait", 0.0) for s in steps) / n
            lines.append(f"  {rank:<6}{len(steps):>6}{sum(s.wall_s for s in steps) / n * 1e3:>9.2f}"
                         f"{sum(s.model_s for s in steps) / n * 1e3:>10.2f}{comm * 1e3:>9.3f}{wait * 1e3:>18.3f}")
    return "\n".join(lines)


def merged_by_step(profile: Profile) -> list[dict]:
    """Per step of rank 0: each rank's wall, model, communication and pipeline-wait seconds for its batches."""
    merged = []
    for step in profile.ranks.get(0, []):
        count = max(1, _num_batches(profile, step))
        entry = {"step": step.index, "kind": step.kind, "num_seqs": step.num_seqs, "ranks": {}}
        for rank, steps in profile.ranks.items():
            mine = [s for s in steps if step.first_batch <= s.first_batch < step.first_batch + count] \
                if rank else [step]
            entry["ranks"][rank] = {key: sum(fn(s) for s in mine) for key, fn in _MERGED_FIELDS.items()}
        merged.append(entry)
    return merged


_MERGED_FIELDS = {
    "wall_s": lambda s: s.wall_s,
    "model_s": lambda s: s.model_s,
    "communication_s": lambda s: s.seconds.get("communication", 0.0),
    "pipeline_wait_s": lambda s: s.seconds.get("pipeline_wait", 0.0),
}


def _num_batches(profile: Profile, step: StepProfile) -> int:
    following = [s.first_batch for s in profile.ranks[0] if s.first_batch > step.first_batch]
    return (min(following) if following else step.first_batch + 1) - step.first_batch


def write_json(profile: Profile, path: Path) -> None:
    def verdicts(summary: StepSummary) -> dict:
        data = asdict(summary)
        data["verdicts"] = [{**asdict(v), "ideal_s": v.ideal_s, "roof_fraction": v.roof_fraction,
                             "gflops_per_s": v.gflops_per_s, "gbytes_per_s": v.gbytes_per_s}
                            for v in summary.verdicts]
        return data

    data = {
        "model": profile.model, "device": profile.device, "dtype": profile.dtype, "peaks": asdict(profile.peaks),
        "attribution": profile.attribution,
        "classes": {"host": list(HOST_CLASSES), "model": list(MODEL_CLASSES)},
        "coverage": {rank: dict(zip(("model", "step"), coverage(steps))) for rank, steps in profile.ranks.items()},
        "summaries": {rank: {kind: verdicts(s) for kind, s in kinds.items()}
                      for rank, kinds in profile.summaries.items()},
        "merged_by_step": merged_by_step(profile),
        "steps": {rank: [asdict(s) for s in steps] for rank, steps in profile.ranks.items()},
    }
    path.write_text(json.dumps(data, indent=1))
