"""One rank's profiler events as per-step times by op class.

Each step range (kvforge:step) is cut into the self time of every event in it: the time an event
spends outside its children. That self time counts for the class of the innermost range around it
that names one; what no class claims is host.other outside the model and model.other inside. The model
range's own self time is model.python: the forward's interpreter time between the ops of named classes
(module calls, the layer loop, argument checks). So the classes of a step add up to its wall time, and
those inside kvforge:model ranges to its model time.

    kvforge:step ───────────────────────────────────────────────────────────────
      host.schedule   kvforge:batch ─────────────────────────────   host.detokenize
                        host.prepare  kvforge:model ───────────  host.sample
                                        norm  gemm.qkv  rotary  attention ...
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvforge.profiler.op_classes import (
    BATCH,
    COMPILED_WORK,
    MODEL,
    MODEL_PYTHON,
    PREFIX,
    STEP,
    class_in_compiled,
    class_of_event,
    is_compiling,
    opens_compiled_region,
    resolve,
)
from kvforge.profiler.work import Work, add_work, batch_kind, batch_work, step_kind

_STEP, _BATCH, _MODEL = PREFIX + STEP, PREFIX + BATCH, PREFIX + MODEL


@dataclass(slots=True)
class StepProfile:
    """One step of one rank: wall, model and per-class seconds, and the work of its batches."""

    rank: int
    index: int  # the step's position in this rank's timeline
    first_batch: int  # index of its first batch among every batch this rank ran while profiled
    kind: str  # prefill, decode, mixed or empty
    num_seqs: int
    num_tokens: int
    wall_s: float
    model_s: float
    seconds: dict[str, float]  # class -> seconds; adds up to wall_s
    device_seconds: dict[str, float]  # class -> GPU kernel seconds launched from it (empty on the CPU)
    work: dict[str, Work] = field(default_factory=dict)
    compiled: bool = False  # the model ran as a compiled graph (op classes by kernel name)
    compiling: bool = False  # torch.compile compiled a graph during the step: left out of the summaries

    @property
    def host_s(self) -> float:
        return self.wall_s - self.model_s


def _duration_s(event) -> float:
    return (event.time_range.end - event.time_range.start) * 1e-6


def _kernel_s(event) -> float:
    return sum(kernel.duration for kernel in getattr(event, "kernels", ())) * 1e-6


@dataclass(slots=True)
class _Split:
    seconds: dict[str, float] = field(default_factory=dict)
    device: dict[str, float] = field(default_factory=dict)
    model_s: float = 0.0
    compiled: bool = False
    compiling: bool = False

    def add(self, cls: str, own_s: float, kernel_s: float) -> None:
        self.seconds[cls] = self.seconds.get(cls, 0.0) + own_s
        if kernel_s:
            self.device[cls] = self.device.get(cls, 0.0) + kernel_s


def _split(step_event, kind: str) -> _Split:
    """The self time of every event of one step's subtree, by class."""
    split = _Split()
    stack = [(step_event, None, False, False)]
    while stack:
        event, label, in_model, in_graph = stack.pop()
        name = event.name
        opens_model = name == _MODEL and not in_model
        if opens_model:
            split.model_s += _duration_s(event)
            in_model = True
        if opens_compiled_region(name):
            in_graph = split.compiled = True
        split.compiling = split.compiling or is_compiling(name)
        label = class_in_compiled(name) if in_graph else class_of_event(name) or label
        children = event.cpu_children
        own = _duration_s(event) - sum(_duration_s(child) for child in children)
        if opens_model:
            cls = MODEL_PYTHON
        else:
            cls = resolve(label, kind) if label else ("model.other" if in_model else "host.other")
        split.add(cls, own, _kernel_s(event))
        stack.extend((child, label, in_model, in_graph) for child in children)
    return split


def _fold_compiled(work: dict[str, Work]) -> dict[str, Work]:
    """The work of a compiled step by the classes it can be measured in (GEMMs together, the fused rest)."""
    folded: dict[str, Work] = {}
    for label, item in work.items():
        add_work(folded, {COMPILED_WORK.get(label, label): item})
    return folded


def _batches_in(step_event, batch_events: list) -> int:
    start, end = step_event.time_range.start, step_event.time_range.end
    return sum(1 for b in batch_events if b.thread == step_event.thread and start <= b.time_range.start < end)


def step_profiles(events, batches: list, inventory, rank: int = 0) -> list[StepProfile]:
    """Per-step profiles from a profiler's events (FunctionEvent list); batches[i] is the SchedulerOutput
    of the i-th batch range in time order, inventory the rank's sizes (work.Inventory)."""
    steps = sorted((e for e in events if e.name == _STEP), key=lambda e: e.time_range.start)
    batch_events = sorted((e for e in events if e.name == _BATCH), key=lambda e: e.time_range.start)
    profiles, next_batch = [], 0
    for index, event in enumerate(steps):
        count = _batches_in(event, batch_events)
        outputs = batches[next_batch : next_batch + count]
        kind = step_kind([batch_kind(o) for o in outputs])
        split = _split(event, kind)
        work: dict[str, Work] = {}
        for output in outputs:
            add_work(work, batch_work(inventory, output))
        profiles.append(StepProfile(
            rank=rank, index=index, first_batch=next_batch, kind=kind,
            num_seqs=sum(len(o.scheduled) for o in outputs),
            num_tokens=sum(len(s.token_ids) for o in outputs for s in o.scheduled),
            wall_s=_duration_s(event), model_s=split.model_s, seconds=split.seconds, device_seconds=split.device,
            work=_fold_compiled(work) if split.compiled else work, compiled=split.compiled,
            compiling=split.compiling,
        ))
        next_batch += count
    return profiles
