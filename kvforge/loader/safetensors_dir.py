"""HF checkpoint folders: config.json plus one or many *.safetensors shards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open


def read_hf_config(model_dir: Path) -> dict:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{model_dir} has no config.json: not a Hugging Face checkpoint folder")
    try:
        return json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_path} is not valid JSON: {err}") from err


def safetensors_files(model_dir: Path) -> list[Path]:
    """The shards named by model.safetensors.index.json, or every *.safetensors file."""
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors weights")
    for file in files:
        if not file.is_file():
            raise ValueError(f"missing weight shard {file}")
    return files


def iterate_safetensors(files: list[Path], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one tensor at a time, so peak memory stays near one tensor. Float tensors are
    cast to dtype; integer and fp8 ones (quantized codes) are kept as they are."""
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    tensor = handle.get_tensor(name)
                    is_codes = not tensor.is_floating_point() or tensor.element_size() == 1
                    yield name, tensor if is_codes else tensor.to(dtype)
        except (OSError, SafetensorError) as err:
            raise ValueError(f"cannot read safetensors file {file}: {err}") from err
