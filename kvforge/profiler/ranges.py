"""The record_function ranges of `kvforge profile`, installed on a live engine and removed afterwards.

Nothing here runs unless a profile is taken: `install` wraps methods and module forwards of one
engine (or one worker's runner) in place, as instance attributes, and `Installed.remove` deletes
them again, so an engine that is not profiled runs exactly the code it would run without this file.

    engine      scheduler.schedule / update_from_output, _record (detokenize, stop strings)
    runner      execute (one batch), _prepare (batch building), the sampler, the compiled decode step
    model       forward and compute_logits (model time), and per module: the linear layers by name
                (qkv / o / mlp), attention, norms, rotary, embedding, MoE router and experts
    ops         silu_and_mul and reshape_and_cache (no module of their own), in the layers' op tables
    collectives every kvforge module's reference to the communicator's functions: all-reduce,
                gather and sends are communication, receives are pipeline waits
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn
from torch.profiler import record_function

from kvforge.profiler.op_classes import ATTENTION, BATCH, MODEL, PREFIX, STEP


def span(label: str) -> record_function:
    """A profiler range named kvforge:<label>; the driver uses it around each engine step."""
    return record_function(PREFIX + label)


def ranged(fn: Callable, *labels: str) -> Callable:
    """fn inside nested ranges kvforge:<label> (outermost first)."""
    names = [PREFIX + label for label in labels]
    if len(names) == 1:
        name = names[0]

        @functools.wraps(fn)
        def call(*args, **kwargs):
            with record_function(name):
                return fn(*args, **kwargs)

        return call

    @functools.wraps(fn)
    def call_nested(*args, **kwargs):
        with record_function(names[0]), record_function(names[1]):
            return fn(*args, **kwargs)

    return call_nested


@dataclass(slots=True)
class Installed:
    """What install() replaced: (object, attribute, previous value or _ABSENT), in order."""

    patches: list[tuple[object, str, object]] = field(default_factory=list)
    batches: list = field(default_factory=list)  # the SchedulerOutput of every batch run while installed

    def patch(self, obj: object, name: str, value: object) -> None:
        self.patches.append((obj, name, obj.__dict__.get(name, _ABSENT) if hasattr(obj, "__dict__") else
                             getattr(obj, name)))
        setattr(obj, name, value)

    def remove(self) -> None:
        """Put every replaced attribute back (instance attributes that did not exist are deleted)."""
        for obj, name, previous in reversed(self.patches):
            if previous is _ABSENT:
                delattr(obj, name)
            else:
                setattr(obj, name, previous)
        self.patches.clear()


_ABSENT = object()

# Linear layers by the last part of their name; under ".experts." they count as MoE experts.
_LINEAR_CLASSES = {
    "qkv_proj": "gemm.qkv", "q_proj": "gemm.qkv", "k_proj": "gemm.qkv", "v_proj": "gemm.qkv",
    "q_a_proj": "gemm.qkv", "q_b_proj": "gemm.qkv", "kv_a_proj_with_mqa": "gemm.qkv", "kv_b_proj": "gemm.qkv",
    "o_proj": "gemm.o", "gate_up_proj": "gemm.mlp", "down_proj": "gemm.mlp", "gate_proj": "gemm.mlp",
    "up_proj": "gemm.mlp", "shared_expert_gate": "moe.routing", "gate": "moe.routing",
}
_COLLECTIVES = {"tp_all_reduce": "communication", "tp_gather": "communication", "send_tensor": "communication",
                "send_object": "communication", "recv_tensor": "pipeline_wait", "recv_object": "pipeline_wait"}
_OPS = {"silu_and_mul": "activation", "reshape_and_cache": "cache_write"}
_RUNNER_METHODS = {"_prepare": "host.prepare", "_sampling_batch": "host.sample", "sampler": "host.sample"}


def module_class(name: str, module: nn.Module) -> str | None:
    """The op class of one of the model's modules, or None for containers and the like."""
    from kvforge.layers.attention import Attention
    from kvforge.layers.embedding import VocabParallelEmbedding
    from kvforge.layers.linear import Linear
    from kvforge.layers.mla import MultiHeadLatentAttention
    from kvforge.layers.moe import FusedMoE
    from kvforge.layers.moe_router import Router
    from kvforge.layers.norm import RMSNorm
    from kvforge.layers.rotary import RotaryEmbedding

    last = name.rsplit(".", 1)[-1]
    if isinstance(module, Linear):
        return "moe.experts" if ".experts." in f".{name}." else _LINEAR_CLASSES.get(last, "gemm.mlp")
    kinds = ((Attention, ATTENTION), (MultiHeadLatentAttention, ATTENTION), (RMSNorm, "norm"),
             (RotaryEmbedding, "rotary"), (VocabParallelEmbedding, "embedding"), (FusedMoE, "moe.experts"),
             (Router, "moe.routing"))
    return next((label for kind, label in kinds if isinstance(module, kind)), None)


def install_model(installed: Installed, model: nn.Module) -> None:
    """Ranges around the model's forward and LM head (model time) and each classified module."""
    for name, module in model.named_modules():
        label = module_class(name, module) if name else None
        if label is not None:
            installed.patch(module, "forward", ranged(module.forward, label))
    install_ops(installed, model)
    installed.patch(model, "forward", ranged(model.forward, MODEL))
    installed.patch(model, "compute_logits", ranged(model.compute_logits, MODEL, "gemm.lm_head"))


def install_ops(installed: Installed, model: nn.Module) -> None:
    """Ranges around the ops without a module of their own, in the op table each layer captured."""
    replaced: dict[int, object] = {}
    for module in model.modules():
        table = vars(module).get("ops")
        if table is None or not dataclasses.is_dataclass(table):
            continue
        if id(table) not in replaced:
            ranged_ops = {name: ranged(getattr(table, name), label) for name, label in _OPS.items()
                          if hasattr(table, name)}
            replaced[id(table)] = dataclasses.replace(table, **ranged_ops)
        installed.patch(module, "ops", replaced[id(table)])


def install_collectives(installed: Installed) -> None:
    """Every kvforge module's reference to a collective (they import the functions by name)."""
    from kvforge.distributed import communicator

    originals = {getattr(communicator, fn_name): label for fn_name, label in _COLLECTIVES.items()}
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("kvforge.") or module_name.startswith("kvforge.profiler"):
            continue
        for attr, value in list(vars(module).items()):
            label = originals.get(value) if isinstance(value, types.FunctionType) else None
            if label is not None:
                installed.patch(module, attr, ranged(value, label))


def install_runner(installed: Installed, runner, batch_is_step: bool = False) -> None:
    """Ranges in one rank's model runner; each batch's SchedulerOutput is kept for the work arithmetic.

    batch_is_step: a worker rank, where one batch is one step of its timeline."""
    execute = runner.execute
    labels = (STEP, BATCH) if batch_is_step else (BATCH,)
    ranged_execute = ranged(execute, *labels)

    def execute_batch(output):
        installed.batches.append(output)
        return ranged_execute(output)

    installed.patch(runner, "execute", execute_batch)
    _wrap_methods(installed, runner, _RUNNER_METHODS)
    graphs = getattr(runner, "decode_graphs", None)
    if graphs is not None:  # compiled decode steps: forward and LM head in one graph, model time all of it;
        # its input copies and guard checks around the graph count with Inductor's code as fused
        installed.patch(graphs, "run", ranged(graphs.run, MODEL, "fused"))
    install_model(installed, runner.model)


# Host parts by method name; the names of either engine layout (those absent are skipped).
_SCHEDULER_METHODS = {"schedule": "host.schedule", "update_from_output": "host.update",
                      "update_after_step": "host.update"}
_ENGINE_METHODS = {"_record": "host.detokenize", "_apply": "host.detokenize", "_make_output": "host.outputs"}


def _wrap_methods(installed: Installed, obj: object, methods: dict[str, str]) -> None:
    for name, label in methods.items():
        if callable(getattr(obj, name, None)):
            installed.patch(obj, name, ranged(getattr(obj, name), label))


def install(engine) -> Installed:
    """Every range on an LLMEngine and this process's runner; remove() takes them all off again."""
    installed = Installed()
    _wrap_methods(installed, engine.scheduler, _SCHEDULER_METHODS)
    _wrap_methods(installed, engine, _ENGINE_METHODS)
    install_runner(installed, engine.runner)
    if getattr(engine.executor, "world_size", 1) > 1:  # one rank: the collectives return at once
        install_collectives(installed)
    return installed
