"""A plan as a text table or as JSON."""

from __future__ import annotations

from dataclasses import asdict

from kvforge.plan.estimate import Plan, SplitEstimate

_GIB = 2**30


def plan_to_dict(plan: Plan) -> dict:
    """Everything in the plan, in plain JSON types (bytes as bytes, speeds in tokens/s and ms)."""
    shape, device = plan.model, plan.device
    return {
        "model": {
            "name": shape.name, "architecture": shape.architecture, "num_layers": shape.num_layers,
            "total_params": shape.total_params, "active_params": shape.active_params,
            "num_experts": shape.num_experts, "max_position": shape.max_position,
        },
        "device": {
            "type": device.name, "count": plan.options.num_devices, "memory_gib": device.memory_gib,
            "memory_bandwidth_gbs": device.peak.memory_bandwidth_gbs,
            "matmul_tflops": plan.precision.matmul_tflops(device), "interconnect": device.interconnect,
            "interconnect_gbs": device.interconnect_gbs,
        },
        "precision": asdict(plan.precision),
        "options": asdict(plan.options),
        "splits": [_split_to_dict(split) for split in plan.splits],
        "recommended": None if plan.recommended is None else {"tp": plan.recommended.tp, "pp": plan.recommended.pp},
        "reason": plan.reason,
    }  # fmt: skip


def _split_to_dict(split: SplitEstimate) -> dict:
    out = asdict(split)
    if split.memory is not None:
        out["memory"]["total"] = split.memory.total
    return out


def format_plan(plan: Plan) -> str:
    """A header on the model and device, one row per split, then the recommendation."""
    shape, device, p, opts = plan.model, plan.device, plan.precision, plan.options
    active = f", {shape.active_params / 1e9:.1f}B active" if shape.num_experts else ""
    link = f"{device.interconnect} {device.interconnect_gbs:g} GB/s" if device.interconnect_gbs else "no interconnect"
    lines = [
        f"model   {shape.name} ({shape.architecture}): {shape.total_params / 1e9:.2f}B parameters{active}, "
        f"{shape.num_layers} layers",
        f"device  {opts.num_devices} x {device.name}: {device.memory_gib:.1f} GiB, "
        f"{device.peak.memory_bandwidth_gbs:g} GB/s, {p.matmul_tflops(device):g} TFLOP/s ({p.weight_dtype}), {link}",
        f"dtypes  weights {p.weight_dtype}, KV cache {p.kv_cache_dtype}; {opts.gpu_memory_utilization:.0%} of memory "
        f"usable; context {opts.context_len} tokens; steps of up to {opts.max_num_batched_tokens} tokens",
        "",
        "memory per device of the fullest stage (GiB); speeds are roofline upper bounds, all devices together",
    ]  # fmt: skip
    header = ("TP", "PP", "weights", "KV", "states", "act", "total", "KV tokens", "max batch", "max ctx", "batch",
              "decode tok/s", "ms/token", "bound", "comm", "prefill tok/s", "TTFT ms")  # fmt: skip
    rows = [_row(split) for split in plan.splits]
    widths = [max(len(header[i]), *(len(row[i]) for row in rows)) for i in range(len(header))]
    lines.append("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for split, row in zip(plan.splits, rows):
        note = "" if split.problem is None else f"  ({split.problem})"
        lines.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) + note)
    lines += ["", f"recommended: {plan.reason}" if plan.recommended is not None else plan.reason]
    return "\n".join(lines)


def _row(split: SplitEstimate) -> tuple[str, ...]:
    blank = ("-",) * 15
    if split.memory is None:
        return (str(split.tp), str(split.pp), *blank)
    m = split.memory
    memory = (f"{m.weights / _GIB:.1f}", f"{m.kv_cache / _GIB:.1f}", f"{m.states / _GIB:.1f}",
              f"{m.activations / _GIB:.2f}", f"{m.total / _GIB:.1f}", f"{m.kv_tokens:,}", str(split.max_batch),
              f"{split.max_context:,}")  # fmt: skip
    if split.decode is None or split.prefill is None:
        return (str(split.tp), str(split.pp), *memory, *blank[:7])
    d, f = split.decode, split.prefill
    speeds = (str(split.batch), f"{d.tokens_per_s:,.0f}", f"{d.latency_ms:.2f}", d.bound, f"{d.comm_share:.0%}",
              f"{f.tokens_per_s:,.0f}", f"{f.latency_ms:,.0f}")  # fmt: skip
    return (str(split.tp), str(split.pp), *memory, *speeds)
