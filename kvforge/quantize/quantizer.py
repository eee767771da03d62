"""Quantize a loaded float model: RTN, GPTQ, AWQ (4/8-bit weights) or W8A8 (SmoothQuant), layer by layer."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from kvforge.engine.llm_engine import LLMEngine
from kvforge.kernels.cpu.dense_gemv import drop_packed_weights
from kvforge.layers.linear import Linear
from kvforge.quantization import quantizable_linears
from kvforge.quantization.config import QuantConfig
from kvforge.quantization.quantized_weight import QuantizedWeight, quantize_rtn
from kvforge.quantization.w8a8 import quantize_weight_int8
from kvforge.quantize.awq import apply_awq
from kvforge.quantize.calibration import calibration_sequences, collect_input_stats, tokenize_texts
from kvforge.quantize.gptq import gptq_quantize
from kvforge.quantize.sequential import LayerInputs, capture_first_layer_inputs, layer_outputs, record_inputs

METHODS = ("rtn", "gptq", "awq", "w8a8")
SMOOTHQUANT_ALPHA = 0.5


@dataclass(slots=True)
class Int8Weight:
    """A W8A8 layer: W ~= codes * scales[:, None] / smooth[None, :] (smooth None: no smoothing)."""

    codes: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N] float32
    smooth: torch.Tensor | None  # [K] float32

    def dequantize(self) -> torch.Tensor:
        weight = self.codes.float() * self.scales[:, None]
        return weight if self.smooth is None else weight / self.smooth[None, :]


@dataclass(frozen=True, slots=True)
class QuantizeOptions:
    method: str
    bits: int = 4
    group_size: int = 64
    sym: bool = False
    act_order: bool = False
    num_sequences: int = 128
    sequence_length: int = 512
    damp: float = 0.01  # GPTQ: dampening, relative to the mean Hessian diagonal
    seed: int = 0  # where the calibration sequences start

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.num_sequences < 1 or self.sequence_length < 2:
            raise ValueError(f"need >= 1 calibration sequences of >= 2 tokens, got {self}")
        if not 0 < self.damp < 1:
            raise ValueError(f"damp must be in (0, 1), got {self.damp}")

    def config(self) -> QuantConfig:
        """The quantization_config of the checkpoint these options produce."""
        if self.method == "w8a8":
            return QuantConfig("w8a8", 8, smoothquant=True)
        if self.method == "awq":
            return QuantConfig("awq", self.bits, self.group_size, sym=False)
        return QuantConfig(
            "gptq",
            self.bits,
            self.group_size,
            sym=self.sym,
            desc_act=self.act_order and self.method == "gptq",
        )


def check_group_size(layers: dict[str, Linear], group_size: int) -> None:
    """Every layer's input width must be a multiple of the group size: a ValueError listing the sizes
    that fit otherwise (the runtime formats and kernels all use groups of one size)."""
    widths = sorted({layer.in_features for layer in layers.values()})
    if group_size == -1 or all(width % group_size == 0 for width in widths):
        return
    common = math.gcd(*widths)
    fitting = [size for size in (16, 32, 64, 128, 256, 512, 1024) if common % size == 0]
    raise ValueError(
        f"group size {group_size} does not divide the input widths {widths}; sizes that do: "
        f"{', '.join(map(str, [*fitting, -1]))} (-1: one group per row)"
    )


def quantize_engine_model(
    engine: LLMEngine, options: QuantizeOptions, calibration_texts: list[str]
) -> dict[str, QuantizedWeight | Int8Weight]:
    """Quantize every quantizable Linear of engine's (float) model; returns name -> quantized weight.

    GPTQ and AWQ go decoder layer by decoder layer (kvforge.quantize.sequential), each on the inputs of
    the already-quantized layers before it, and leave the model's linear weights at their dequantized
    values; AWQ also rewrites float weights in place (norms, the up half of gate_up)."""
    options.config()  # validates bits and group size for the method
    model = engine.local_model
    drop_packed_weights(model)  # the layers' weights change below, and the forward passes must see them
    layers = quantizable_linears(model)
    check_group_size(layers, options.group_size)
    if options.method == "rtn":
        return {name: quantize_rtn(layer.weight.data.float(), options.bits, options.group_size, options.sym)
                for name, layer in layers.items()}  # fmt: skip
    token_ids = tokenize_texts(engine, calibration_texts)
    sequences = calibration_sequences(
        token_ids, min(options.sequence_length, engine.max_model_len), options.num_sequences, options.seed
    )
    if options.method == "w8a8":
        stats = collect_input_stats(engine, layers, sequences, with_hessian=False)
        return {name: _smoothquant(layer.weight.data.float(), stats[name].abs_max)
                for name, layer in layers.items()}  # fmt: skip
    return _layer_by_layer(engine, options, sequences)


def _layer_by_layer(
    engine: LLMEngine, options: QuantizeOptions, sequences: list[list[int]]
) -> dict[str, QuantizedWeight]:
    model = engine.local_model
    inputs = capture_first_layer_inputs(engine, model.stage_layers[0], sequences)
    results: dict[str, QuantizedWeight] = {}
    for index, decoder_layer in enumerate(tqdm(model.stage_layers, desc=options.method, unit="layer")):
        linears = quantizable_linears(decoder_layer)
        quantize = _gptq_layer if options.method == "gptq" else _awq_layer
        for name, result in quantize(decoder_layer, linears, inputs, options).items():
            results[f"layers.{model.start_layer + index}.{name}"] = result
        inputs = layer_outputs(decoder_layer, inputs)
    return results


def _gptq_layer(
    decoder_layer: nn.Module, linears: dict[str, Linear], inputs: LayerInputs, options: QuantizeOptions
) -> dict[str, QuantizedWeight]:
    """Each linear on the inputs that the already-quantized linears before it in the layer produce."""
    results = {}
    for name, linear in linears.items():
        stats = record_inputs(decoder_layer, inputs, {name: linear}, with_hessian=True)[name]
        results[name] = gptq_quantize(linear.weight.data, stats.mean_hessian(), options.bits,
                                      options.group_size, options.sym, options.act_order, options.damp)  # fmt: skip
        with torch.no_grad():
            linear.weight.copy_(results[name].dequantize())
    return results


def _awq_layer(
    decoder_layer: nn.Module, linears: dict[str, Linear], inputs: LayerInputs, options: QuantizeOptions
) -> dict[str, QuantizedWeight]:
    stats = record_inputs(decoder_layer, inputs, linears, with_hessian=False)
    apply_awq(decoder_layer, stats, options.bits, options.group_size)
    results = {}
    for name, linear in linears.items():
        results[name] = quantize_rtn(linear.weight.data, options.bits, options.group_size, sym=False)
        with torch.no_grad():
            linear.weight.copy_(results[name].dequantize())
    return results


def _smoothquant(weight: torch.Tensor, act_abs_max: torch.Tensor) -> Int8Weight:
    """s_k = max|x_k|^alpha / max|W_:k|^(1 - alpha); quantize W diag(s) per row."""
    weight_abs_max = weight.abs().amax(dim=0).clamp(min=1e-5)
    smooth = act_abs_max.clamp(min=1e-5).pow(SMOOTHQUANT_ALPHA) / weight_abs_max.pow(1 - SMOOTHQUANT_ALPHA)
    smooth = smooth.clamp(min=1e-5).half().float()
    codes, scales = quantize_weight_int8(weight * smooth[None, :])
    return Int8Weight(codes, scales, smooth)


def fake_quantize(engine: LLMEngine, results: dict[str, QuantizedWeight | Int8Weight]) -> None:
    """Replace each float weight by its dequantized value: the in-memory twin of the quantized model."""
    layers = quantizable_linears(engine.local_model)
    drop_packed_weights(engine.local_model)
    with torch.no_grad():
        for name, result in results.items():
            layers[name].weight.copy_(result.dequantize())
