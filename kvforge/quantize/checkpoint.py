"""Write a quantized model as a Hugging Face checkpoint folder that `LLM(model=folder)` loads:
config.json with quantization_config, model.safetensors (GPTQ / AWQ / W8A8 tensors, float rest) and
the tokenizer files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from kvforge.models.llama import _MERGED
from kvforge.quantization.config import QuantConfig
from kvforge.quantization.formats import AWQ_ORDER, pack_int32
from kvforge.quantization.quantized_weight import QuantizedWeight
from kvforge.quantize.quantizer import Int8Weight
from kvforge.tokenizer import Tokenizer

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)
# merged parameter fragment -> checkpoint fragments, by shard
_SPLITS: dict[str, list[str]] = {}
for _fragment, (_merged, _shard) in sorted(_MERGED.items(), key=lambda item: item[1][1]):
    _SPLITS.setdefault(_merged, []).append(_fragment)


def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


def _layer_tensors(result: QuantizedWeight | Int8Weight, config: QuantConfig) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one (unmerged) layer, output features as given."""
    if isinstance(result, Int8Weight):
        return {
            "weight": result.codes,
            "weight_scale": result.scales,
            "smooth_factor": None if result.smooth is None else result.smooth.clone(),
        }
    restore = torch.argsort(result.perm) if result.perm is not None else None
    codes = result.codes.to(torch.int64)
    if restore is not None:
        codes = codes[:, restore]  # back to the original input order; g_idx records the groups
    zeros = result.zeros.to(torch.int64)
    scales = result.scales.t().half().contiguous()  # [G, N]
    if config.method == "awq":
        return {
            "qweight": pack_int32(codes.t(), 4, dim=1, order=AWQ_ORDER),
            "qzeros": pack_int32(zeros.t(), 4, dim=1, order=AWQ_ORDER),
            "scales": scales,
        }
    zero_offset = 1 if config.checkpoint_format == "gptq" else 0  # v1's off-by-one
    return {
        "qweight": pack_int32(codes.t(), result.bits, dim=0),
        "qzeros": pack_int32(zeros.t() - zero_offset, result.bits, dim=1),
        "scales": scales,
        "g_idx": result.g_idx(),
    }


def _rows(result: QuantizedWeight | Int8Weight, start: int, size: int) -> QuantizedWeight | Int8Weight:
    if isinstance(result, Int8Weight):
        return Int8Weight(
            result.codes[start : start + size], result.scales[start : start + size], result.smooth
        )
    return QuantizedWeight(
        result.codes[start : start + size],
        result.scales[start : start + size],
        result.zeros[start : start + size],
        result.bits,
        result.perm,
    )


def checkpoint_tensors(model: nn.Module, results: dict, config: QuantConfig) -> dict[str, torch.Tensor]:
    """HF-named tensors: quantized layers split back into q/k/v and gate/up, every other parameter as is."""
    tensors: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        layer_name, param_name = name.rsplit(".", 1)
        if layer_name in results and param_name == "weight":
            continue
        tensors[_hf_name(name)] = param.data
    for layer_name, result in results.items():
        layer = model.get_submodule(layer_name)
        merged = next((m for m in _SPLITS if m[:-1] in f".{layer_name}"), None)
        if merged is None:
            parts = [(layer_name, result)]
        else:
            parts = [
                (f".{layer_name}.".replace(merged, fragment)[1:-1], _rows(result, start, size))
                for fragment, start, size in zip(_SPLITS[merged], layer.shard_offsets, layer.shard_sizes, strict=True)
            ]
        for part_name, part in parts:
            for suffix, tensor in _layer_tensors(part, config).items():
                if tensor is not None:
                    tensors[_hf_name(f"{part_name}.{suffix}")] = tensor
    for name in list(tensors):  # split merged biases too
        for merged, fragments in _SPLITS.items():
            if merged[:-1] + ".bias" in name:
                layer = model.get_submodule(name.removeprefix("model.").rsplit(".", 1)[0])
                bias = tensors.pop(name)
                for fragment, start, size in zip(fragments, layer.shard_offsets, layer.shard_sizes, strict=True):
                    tensors[name.replace(merged[:-1], fragment[:-1])] = bias[start : start + size]
    return {name: t.contiguous() for name, t in tensors.items()}


def write_checkpoint(
    out_dir: Path,
    hf_config: dict,
    tensors: dict[str, torch.Tensor],
    config: QuantConfig,
    tokenizer: Tokenizer,
    source: Path | None,
) -> None:
    """Write config.json, model.safetensors and tokenizer files (copied from a source folder, or saved)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    hf = {**hf_config, "quantization_config": config.to_hf()}
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    if source is not None and source.is_dir():
        for file_name in _TOKENIZER_FILES:
            if (source / file_name).is_file():
                shutil.copy(source / file_name, out_dir / file_name)
        return
    tokenizer.backend.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "chat_template": tokenizer.chat_template,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    if tokenizer.extra_eos_token_ids:
        eos_ids = [tokenizer.eos_token_id, *tokenizer.extra_eos_token_ids]
        (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}, indent=2))
