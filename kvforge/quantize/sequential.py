"""Run a model's decoder layers one at a time over the calibration sequences, so that each layer is
quantized on the inputs that the already-quantized layers before it produce (GPTQ's true-sequential
order), and so that a statistic of one linear layer costs only the part of one decoder layer before it.

    capture:  engine.score(sequence), stopped at decoder layer 0: its arguments per sequence are kept
    replay:   layer(positions, x, residual, kv_cache, metadata) per sequence, with hooks on the linear
              layers that record their inputs, stopping after the last one wanted, or run to the end
              to give the next layer's inputs

NOTE: every replay uses the KV cache tensors of layer 0 and the slot mapping of its sequence's capture.
A prefill writes its keys and values before attending over them, and replays run one sequence at a
time with the engine otherwise idle, so the layers can share one cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvforge.engine.llm_engine import LLMEngine
from kvforge.layers.linear import Linear
from kvforge.quantize.calibration import InputStats


class _StopForward(Exception):
    """Raised by a hook once it has what it came for; caught by the code that set the hook."""


@dataclass(slots=True)
class LayerInputs:
    """The arguments of one decoder layer for every calibration sequence."""

    positions: list[torch.Tensor]
    hidden: list[torch.Tensor]  # [num_tokens, hidden_size] per sequence
    residual: list[torch.Tensor | None]
    metadata: list[object]
    kv_cache: tuple[torch.Tensor, torch.Tensor]


def capture_first_layer_inputs(engine: LLMEngine, first_layer: nn.Module, sequences: list[list[int]]) -> LayerInputs:
    """Score each sequence up to the first decoder layer and keep that layer's arguments."""
    captured: list[tuple] = []

    def stop(_: nn.Module, args: tuple) -> None:
        positions, x, residual, kv_cache, metadata = args
        captured.append((positions.clone(), x.clone(), None if residual is None else residual.clone(),
                         metadata, kv_cache))  # fmt: skip
        raise _StopForward

    handle = first_layer.register_forward_pre_hook(stop)
    try:
        for token_ids in sequences:
            try:
                engine.score(token_ids)
            except _StopForward:
                pass  # the rest of the model is not needed
    finally:
        handle.remove()
    return LayerInputs([c[0] for c in captured], [c[1] for c in captured], [c[2] for c in captured],
                       [c[3] for c in captured], captured[0][4])  # fmt: skip


@torch.inference_mode()
def record_inputs(
    layer: nn.Module, inputs: LayerInputs, linears: dict[str, Linear], with_hessian: bool
) -> dict[str, InputStats]:
    """Replay layer over every sequence until each of linears has seen its input; their statistics."""
    stats = {name: InputStats.empty(linear.in_features, with_hessian, len(inputs.hidden), seed=index)
             for index, (name, linear) in enumerate(linears.items())}  # fmt: skip
    last = list(linears.values())[-1]

    def hook(module: nn.Module, args: tuple, name: str) -> None:
        stats[name].add(args[0])
        if module is last:
            raise _StopForward

    handles = [linear.register_forward_pre_hook(lambda m, a, n=name: hook(m, a, n))
               for name, linear in linears.items()]  # fmt: skip
    try:
        for index in range(len(inputs.hidden)):
            try:
                _call(layer, inputs, index)
            except _StopForward:
                pass  # the rest of the layer is not needed
    finally:
        for handle in handles:
            handle.remove()
    return stats


@torch.inference_mode()
def layer_outputs(layer: nn.Module, inputs: LayerInputs) -> LayerInputs:
    """The next decoder layer's inputs: this layer run to the end on every sequence."""
    hidden, residual = [], []
    for index in range(len(inputs.hidden)):
        x, res = _call(layer, inputs, index)
        hidden.append(x)
        residual.append(res)
    return LayerInputs(inputs.positions, hidden, residual, inputs.metadata, inputs.kv_cache)


def _call(layer: nn.Module, inputs: LayerInputs, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """NOTE: on copies, since the fused residual-add norms may write into their arguments."""
    residual = inputs.residual[index]
    return layer(inputs.positions[index], inputs.hidden[index].clone(),
                 None if residual is None else residual.clone(), inputs.kv_cache, inputs.metadata[index])  # fmt: skip
