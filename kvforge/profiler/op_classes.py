"""The op classes a step's time is split into, and how a profiler event's name maps to one.

A range the profiler places is named `kvforge:<class>` (see ranges.py). Events without one of ours
take the class of the innermost enclosing range. Inside a compiled graph (a decode step under
torch.compile) there are no ranges: the custom ops' own names (`kvforge::paged_attention`, ...) still
name their class, the matmuls are gemm.compiled and everything else Inductor fused is "fused".
"""

from __future__ import annotations

PREFIX = "kvforge:"
STEP = "step"  # one engine step (rank 0) or one batch through a worker (other ranks)
BATCH = "batch"  # one SchedulerOutput through this rank's model runner
MODEL = "model"  # the model's forward and its LM head: everything inside is model time
MODEL_PYTHON = "model.python"  # the model range's own self time: Python between the ops of named classes

HOST_CLASSES = ("host.schedule", "host.prepare", "host.sample", "host.detokenize", "host.update", "host.outputs",
                "host.other")
MODEL_CLASSES = ("embedding", "gemm.qkv", "gemm.o", "gemm.mlp", "gemm.lm_head", "gemm.compiled",
                 "attention.prefill", "attention.decode", "cache_write", "norm", "rotary", "activation",
                 "moe.routing", "moe.experts", "fused", MODEL_PYTHON, "model.other")
PARALLEL_CLASSES = ("communication", "pipeline_wait")
ALL_CLASSES = HOST_CLASSES + MODEL_CLASSES + PARALLEL_CLASSES
GEMM_CLASSES = ("gemm.qkv", "gemm.o", "gemm.mlp", "gemm.lm_head")
# NOTE: "attention" is a range name only; a step's kind decides which of the two classes it counts as.
ATTENTION = "attention"

# Inside a compiled graph our ranges are gone (dynamo drops them): the opaque custom ops keep their names,
# the matmuls Inductor calls out to are GEMMs of no known layer, and the rest is its fused code.
_COMPILED_REGION = ("Torch-Compiled Region", "CompiledFunction", "## Call CompiledFxGraph")
_COMPILING = ("(dynamo_timed)", "entire_frame_compile")
_GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::_weight_int", "mkldnn::", "mkl::")
_CUSTOM_OP_WORDS = (("attention", ATTENTION), ("decode", ATTENTION), ("cache", "cache_write"), ("moe", "moe.experts"),
                    ("gemm", "gemm.compiled"), ("gemv", "gemm.compiled"), ("norm", "fused"), ("rotary", "fused"))
# Compiled-step classes that stand for several eager ones (their work is counted together).
COMPILED_WORK = {"gemm.qkv": "gemm.compiled", "gemm.o": "gemm.compiled", "gemm.mlp": "gemm.compiled",
                 "gemm.lm_head": "gemm.compiled", "norm": "fused", "rotary": "fused", "activation": "fused",
                 "embedding": "fused"}


def class_of_event(name: str) -> str | None:
    """The class one of our ranges names, or None when the event takes its enclosing range's."""
    if name.startswith(PREFIX) and not name.startswith(PREFIX + ":"):
        label = name[len(PREFIX):]
        return None if label in (STEP, BATCH, MODEL) else label
    return None


def class_in_compiled(name: str) -> str:
    """The class of an event inside a compiled graph."""
    if name.startswith("kvforge") and "::" in name:
        op = name.split("::", 1)[1]
        return next((label for word, label in _CUSTOM_OP_WORDS if word in op), "fused")
    if name.startswith(_GEMM_OPS):
        return "gemm.compiled"
    return "fused"


def opens_compiled_region(name: str) -> bool:
    return name.startswith(_COMPILED_REGION)


def is_compiling(name: str) -> bool:
    """An event of torch.compile compiling a graph (a step holding one measures the compiler, not the model)."""
    return any(marker in name for marker in _COMPILING)


def resolve(label: str, step_kind: str) -> str:
    """A range label as a reported class: attention becomes prefill or decode attention by the step."""
    if label == ATTENTION:
        return "attention.decode" if step_kind == "decode" else "attention.prefill"
    return label
