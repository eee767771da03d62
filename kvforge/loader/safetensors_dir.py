"""HF checkpoint folders: config.json plus one or many *.safetensors shards."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
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


# Stored bytes of each safetensors dtype name.
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}


def _is_codes(floating: bool, element_bytes: int) -> bool:
    """Integer and fp8 tensors (quantized codes) load as they are stored; the other floats in the run dtype."""
    return not floating or element_bytes == 1


@contextmanager
def _opened(file: Path) -> Iterator:
    try:
        with safe_open(str(file), framework="pt") as handle:
            yield handle
    except (OSError, SafetensorError) as err:
        raise ValueError(f"cannot read safetensors file {file}: {err}") from err


def iterate_safetensors(files: list[Path], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one tensor at a time, so peak memory stays near one tensor. Float tensors are
    cast to dtype; integer and fp8 ones (quantized codes) are kept as they are."""
    for file in files:
        with _opened(file) as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                yield name, tensor if _is_codes(tensor.is_floating_point(), tensor.element_size()) else tensor.to(dtype)


def safetensors_weight_bytes(files: list[Path], dtype: torch.dtype) -> int:
    """Bytes the files' tensors take as iterate_safetensors loads them, read from their headers alone."""
    total = 0
    for file in files:
        with _opened(file) as handle:
            for name in handle.keys():
                part = handle.get_slice(name)
                stored = _DTYPE_BYTES.get(part.get_dtype(), 4)
                floating = part.get_dtype().startswith(("F", "BF"))
                total += math.prod(part.get_shape()) * (stored if _is_codes(floating, stored) else dtype.itemsize)
    return total
