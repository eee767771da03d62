"""The plan: for every TP x PP split of the devices, memory per device, the largest batch and context that
fit, decode and prefill speed bounds; and the split to use.

Memory per device mirrors the engine: of `gpu_memory_utilization` x capacity, weights, rotary tables and
the largest step's activations come first, and the KV cache takes what max_num_seqs sequences of the model's
length need, at most the rest (on the CPU at most the engine's default budget); or `kv_cache_memory`, when given
(executor/kv_cache_memory.py; the memory free when the engine starts is not known here). Every stage holds the
same number of cached tokens, so the fullest stage sets it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvforge.config import CacheConfig
from kvforge.executor.kv_cache_memory import DEFAULT_CPU_KV_CACHE_BYTES, blocks_needed
from kvforge.plan.devices import DeviceSpec
from kvforge.plan.model_shape import ModelShape
from kvforge.plan.precision import Precision
from kvforge.plan.stage import Stage, build_stages, layer_range
from kvforge.plan.throughput import Roofline, SpeedEstimate, decode_speed, prefill_speed


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """What to plan for; the engine's own defaults where the engine has the same knob."""

    num_devices: int = 1
    context_len: int = 4096  # tokens per sequence (prompt + output) at which batch and speed are given
    batch_size: int | None = None  # None: the largest batch that fits, up to max_num_seqs
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None  # KV cache bytes per device; None: as the engine sizes it by default
    num_state_checkpoints: int = CacheConfig().num_state_checkpoints  # hybrid models' states kept for prefix hits

    def __post_init__(self) -> None:
        for name in ("num_devices", "context_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be >= 1 byte, got {self.kv_cache_memory}")


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Bytes on one device of the fullest pipeline stage."""

    weights: float
    buffers: float  # rotary cos/sin tables
    packed_weights: float  # float32 on the CPU: the layers' and head's weights packed for oneDNN, a second copy
    activations: float
    kv_cache: float
    kv_bytes_per_token: float
    kv_tokens: int  # cached tokens every stage has room for
    states: float = 0.0  # a hybrid model's linear-attention state slots (running requests, padding, checkpoints)

    @property
    def total(self) -> float:
        return self.fixed + self.kv_cache

    @property
    def fixed(self) -> float:
        """Memory that does not depend on the KV cache size."""
        return self.weights + self.buffers + self.packed_weights + self.activations + self.states


@dataclass(frozen=True, slots=True)
class SplitEstimate:
    """One TP x PP split. `problem` says why it is not usable (None when it is)."""

    tp: int
    pp: int
    problem: str | None = None
    memory: MemoryEstimate | None = None
    max_batch: int = 0  # sequences of context_len tokens that fit
    max_context: int = 0  # tokens one sequence may reach (the model's max position caps it)
    batch: int = 0  # the batch the speeds are for
    decode: SpeedEstimate | None = None
    prefill: SpeedEstimate | None = None

    @property
    def fits(self) -> bool:
        return self.problem is None


@dataclass(frozen=True, slots=True)
class Plan:
    model: ModelShape
    device: DeviceSpec
    precision: Precision
    options: PlanOptions
    splits: list[SplitEstimate] = field(default_factory=list)
    recommended: SplitEstimate | None = None
    reason: str = ""


def make_plan(shape: ModelShape, device: DeviceSpec, precision: Precision, options: PlanOptions) -> Plan:
    """Estimate every split of options.num_devices devices and pick one."""
    if options.num_devices > 1 and device.interconnect_gbs is None:
        raise ValueError(f"{device.name} has no device-to-device interconnect: plan for --devices 1")
    if options.context_len > shape.max_position:
        raise ValueError(f"--context {options.context_len} exceeds {shape.name}'s "
                         f"{shape.max_position} positions")  # fmt: skip
    if precision.kv_value_bytes == 1 and shape.num_kv_heads == 0:
        raise ValueError(f"{shape.name}'s latent (MLA) KV cache is kept unquantized: use --kv-cache-dtype auto")
    splits = [
        estimate_split(shape, device, precision, options, tp, options.num_devices // tp)
        for tp in range(1, options.num_devices + 1) if options.num_devices % tp == 0
    ]  # fmt: skip
    recommended, reason = _recommend(splits, options)
    return Plan(shape, device, precision, options, splits, recommended, reason)


def split_problem(shape: ModelShape, tp: int, pp: int) -> str | None:
    """Why a split cannot cut this model, or None."""
    for size in shape.tp_divisors:
        if size % tp:
            return f"TP={tp} does not divide {size} (heads or intermediate size)"
    kv = shape.num_kv_heads
    if kv and kv % tp and tp % kv:
        return f"TP={tp} neither divides nor is a multiple of the {kv} KV heads"
    if pp > shape.num_layers:
        return f"PP={pp} exceeds the {shape.num_layers} layers"
    if any(layer.state_fp32_values for layer in shape.layers):  # a hybrid model: every stage needs both kinds
        for stage in range(pp):
            linear = [bool(layer.state_fp32_values) for layer in shape.layers[slice(*layer_range(shape.num_layers,
                                                                                                 pp, stage))]]
            for kind, is_linear in (("full", False), ("linear", True)):
                if is_linear not in linear:
                    return f"PP={pp} gives stage {stage} no {kind}-attention layer (the engine needs both kinds)"
    return None


def estimate_split(
    shape: ModelShape, device: DeviceSpec, precision: Precision, options: PlanOptions, tp: int, pp: int
) -> SplitEstimate:
    problem = split_problem(shape, tp, pp)
    if problem is not None:
        return SplitEstimate(tp, pp, problem)
    stages = build_stages(shape, tp, pp, precision, options.max_num_batched_tokens, options.max_num_seqs,
                          packs=device.host and precision.weight_bytes == 4, context_len=options.context_len)
    usable = device.memory_bytes * options.gpu_memory_utilization
    limits = [_default_kv_budget(usable - stage.fixed_bytes, device) for stage in stages]
    requests, problem = _requests_whose_states_fit(stages, limits, options)
    states = [(requests + 1 + options.num_state_checkpoints) * stage.state_bytes_per_seq for stage in stages]
    budgets = [options.kv_cache_memory or limit - state for limit, state in zip(limits, states)]
    kv_tokens = max(0, min(int(budget // stage.kv_bytes_per_token) for budget, stage in zip(budgets, stages)))
    if options.kv_cache_memory is None:
        kv_tokens = min(kv_tokens, _tokens_needed(shape, options))
    fullest, state = max(zip(stages, states), key=lambda pair: pair[0].fixed_bytes + pair[1]
                         + kv_tokens * pair[0].kv_bytes_per_token)  # fmt: skip
    memory = MemoryEstimate(fullest.weight_bytes, fullest.buffer_bytes, fullest.packed_bytes, fullest.activation_bytes,
                            kv_tokens * fullest.kv_bytes_per_token, fullest.kv_bytes_per_token, kv_tokens,
                            state)  # fmt: skip
    max_batch = min(kv_tokens // options.context_len, requests)
    if problem is not None:
        return SplitEstimate(tp, pp, problem, memory, max_batch, min(kv_tokens, shape.max_position), 0)
    batch = options.batch_size or max(1, min(max_batch, options.max_num_seqs))
    estimate = SplitEstimate(tp, pp, None, memory, max_batch, min(kv_tokens, shape.max_position), batch)
    problem = _memory_problem(memory, usable, options, max_batch, batch)
    if memory.fixed > usable:
        return replace(estimate, problem=problem)
    roofline = Roofline(shape, device, precision, tp)
    return replace(
        estimate, problem=problem, decode=decode_speed(roofline, stages, batch, options.context_len),
        prefill=prefill_speed(roofline, stages, options.context_len, options.max_num_batched_tokens),
    )  # fmt: skip


def _requests_whose_states_fit(stages: list[Stage], limits: list[float], options: PlanOptions
                               ) -> tuple[int, str | None]:  # fmt: skip
    """The requests the engine runs at once (Worker.kv_cache_size): max_num_seqs, or as many as a hybrid model's
    linear-attention states fit in half of each stage's memory beside its padding slot and checkpoints; and a problem
    where not one fits."""
    fits = [(limit / 2 - (1 + options.num_state_checkpoints) * stage.state_bytes_per_seq) // stage.state_bytes_per_seq
            for stage, limit in zip(stages, limits) if stage.state_bytes_per_seq]
    requests = int(min([options.max_num_seqs, *fits]))
    if requests >= 1:
        return requests, None
    per_seq = max(stage.state_bytes_per_seq for stage in stages)
    return 0, f"a request's linear-attention states ({per_seq / 2**20:.1f} MiB) do not fit in half the memory left"


def _default_kv_budget(left: float, device: DeviceSpec) -> float:
    """The bytes a KV cache sized by default may take: what is left, on the CPU at most the engine's default."""
    return min(left, DEFAULT_CPU_KV_CACHE_BYTES) if device.host else left


def _tokens_needed(shape: ModelShape, options: PlanOptions) -> int:
    """What a cache sized by default holds at most: max_num_seqs sequences of the model's length, in whole blocks."""
    block_size = CacheConfig().block_size
    return (blocks_needed(options.max_num_seqs, shape.max_position, block_size) - 1) * block_size


def _memory_problem(memory: MemoryEstimate, usable: float, options: PlanOptions, max_batch: int, batch: int
                    ) -> str | None:  # fmt: skip
    gib = 2**30
    fixed = memory.fixed
    if fixed > usable:
        return (f"weights and activations need {fixed / gib:.1f} GiB per device, "
                f"{usable / gib:.1f} GiB usable")  # fmt: skip
    if memory.total > usable:
        return f"needs {memory.total / gib:.1f} GiB per device with the KV cache, {usable / gib:.1f} GiB usable"
    if max_batch < batch:
        return (f"KV cache holds {memory.kv_tokens:,} tokens: {max_batch} sequences of {options.context_len} "
                f"tokens, not {batch}")  # fmt: skip
    return None


def _recommend(splits: list[SplitEstimate], options: PlanOptions) -> tuple[SplitEstimate | None, str]:
    usable = [s for s in splits if s.fits and s.decode is not None]
    if not usable:
        shown = [f"TP={s.tp} x PP={s.pp}: {s.problem}" for s in splits]
        return None, "no split fits: " + "; ".join(shown)
    # NOTE: speeds within 2% are a tie, broken by the shorter time per token, then the fewer stages.
    best_speed = max(s.decode.tokens_per_s for s in usable)
    ties = [s for s in usable if s.decode.tokens_per_s >= 0.98 * best_speed]
    best = min(ties, key=lambda s: (s.decode.latency_ms, s.pp))
    reason = (f"TP={best.tp} x PP={best.pp}: the highest decode throughput bound among the splits that fit "
              f"({best.decode.tokens_per_s:,.0f} tokens/s at batch {best.batch} x {options.context_len} tokens, "
              f"{best.decode.latency_ms:.1f} ms per token, {best.decode.bound}-bound, "
              f"{best.decode.comm_share:.0%} of the step in all-reduces)")  # fmt: skip
    runner_up = [s for s in usable if s is not best]
    if runner_up:
        second = max(runner_up, key=lambda s: s.decode.tokens_per_s)
        reason += (f"; next TP={second.tp} x PP={second.pp} at {second.decode.tokens_per_s:,.0f} tokens/s "
                   f"(batch {second.batch})")  # fmt: skip
    return best, reason
