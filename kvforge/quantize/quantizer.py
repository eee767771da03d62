"""Quantize a loaded float model: RTN, GPTQ, AWQ (4/8-bit weights) or W8A8 (SmoothQuant), layer by layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from kvforge.engine.llm_engine import LLMEngine
from kvforge.quantization import quantizable_linears
from kvforge.quantization.config import QuantConfig
from kvforge.quantization.quantized_weight import QuantizedWeight, quantize_rtn
from kvforge.quantization.w8a8 import quantize_weight_int8
from kvforge.quantize.awq import apply_awq_scales
from kvforge.quantize.calibration import calibration_sequences, collect_input_stats
from kvforge.quantize.gptq import gptq_quantize

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
    num_sequences: int = 16
    sequence_length: int = 512

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.num_sequences < 1 or self.sequence_length < 2:
            raise ValueError(f"need >= 1 calibration sequences of >= 2 tokens, got {self}")

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


def quantize_engine_model(
    engine: LLMEngine, options: QuantizeOptions, calibration_text: str
) -> dict[str, QuantizedWeight | Int8Weight]:
    """Quantize every quantizable Linear of engine's (float) model; returns name -> quantized weight.

    AWQ also rewrites float weights of the model in place (norms, the up half of gate_up)."""
    options.config()  # validates bits and group size for the method
    model = engine.local_model
    layers = quantizable_linears(model)
    stats = {}
    if options.method != "rtn":
        sequences = calibration_sequences(
            engine, calibration_text, options.sequence_length, options.num_sequences
        )
        stats = collect_input_stats(engine, layers, sequences, with_hessian=options.method == "gptq")
    if options.method == "awq":
        for index, decoder_layer in enumerate(tqdm(model.layers, desc="awq scales", unit="layer")):
            apply_awq_scales(decoder_layer, stats, f"layers.{index}", options.bits, options.group_size)
    results: dict[str, QuantizedWeight | Int8Weight] = {}
    for name, layer in tqdm(layers.items(), desc=f"{options.method} quantize", unit="layer"):
        weight = layer.weight.data.float()
        if options.method == "gptq":
            results[name] = gptq_quantize(
                weight,
                stats[name].mean_hessian(),
                options.bits,
                options.group_size,
                options.sym,
                options.act_order,
            )
        elif options.method == "w8a8":
            results[name] = _smoothquant(weight, stats[name].abs_max)
        else:
            results[name] = quantize_rtn(
                weight, options.bits, options.group_size, options.sym if options.method == "rtn" else False
            )
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
    with torch.no_grad():
        for name, result in results.items():
            layers[name].weight.copy_(result.dequantize())
