"""The op classes a step's time is split into, and how a profiler event's name maps to one.

A range the profiler places is named `kvforge:<class>` (see ranges.py). Events without one of ours
take the class of the innermost enclosing range; when the step is compiled (no ranges inside the
graph), the custom ops' own names (`kvforge::paged_attention`, ...) and the compiled graph's kernels
still name a class.
"""

from __future__ import annotations

PREFIX = "kvforge:"
STEP = "step"  # one engine step (rank 0) or one batch through a worker (other ranks)
BATCH = "batch"  # one SchedulerOutput through this rank's model runner
MODEL = "model"  # the model's forward and its LM head: everything inside is model time

HOST_CLASSES = ("host.schedule", "host.prepare", "host.sample", "host.detokenize", "host.update", "host.outputs",
                "host.other")
MODEL_CLASSES = ("embedding", "gemm.qkv", "gemm.o", "gemm.mlp", "gemm.lm_head", "attention.prefill",
                 "attention.decode", "cache_write", "norm", "rotary", "activation", "moe.routing", "moe.experts",
                 "fused", "model.other")
PARALLEL_CLASSES = ("communication", "pipeline_wait")
ALL_CLASSES = HOST_CLASSES + MODEL_CLASSES + PARALLEL_CLASSES
GEMM_CLASSES = ("gemm.qkv", "gemm.o", "gemm.mlp", "gemm.lm_head")
# NOTE: "attention" is a range name only; a step's kind decides which of the two classes it counts as.
ATTENTION = "attention"

# Profiler event names of the custom ops (and the compiled graph) -> class, for a compiled step.
_OP_NAMES = {
    "kvforge::rms_norm": "norm",
    "kvforge::fused_add_rms_norm": "norm",
    "kvforge::rotary_embedding": "rotary",
    "kvforge::silu_and_mul": "activation",
    "kvforge::reshape_and_cache": "cache_write",
    "kvforge::paged_attention": ATTENTION,
    "kvforge::mla_decode": ATTENTION,
    "kvforge::fused_moe": "moe.experts",
}
_FUSED_MARKERS = ("Torch-Compiled Region", "CompiledFunction", "cpp_fused", "triton_", "inductor")


def class_of_event(name: str) -> str | None:
    """The class an event names by itself, or None when it takes its enclosing range's."""
    if name.startswith(PREFIX) and not name.startswith(PREFIX + ":"):
        label = name[len(PREFIX):]
        return None if label in (STEP, BATCH, MODEL) else label
    found = _OP_NAMES.get(name)
    if found is not None:
        return found
    if any(marker in name for marker in _FUSED_MARKERS):
        return "fused"
    return None


def is_compiled_event(name: str) -> bool:
    return any(marker in name for marker in _FUSED_MARKERS)


def resolve(label: str, step_kind: str) -> str:
    """A range label as a reported class: attention becomes prefill or decode attention by the step."""
    if label == ATTENTION:
        return "attention.decode" if step_kind == "decode" else "attention.prefill"
    return label
