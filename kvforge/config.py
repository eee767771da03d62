"""Frozen engine configuration. Each component receives only its own sub-config."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # "auto": the model dtype; int8 / fp8: codes + scales
QUANTIZATIONS = ("w8a16", "w4a16", "w8a8", "fp8", "gguf")  # at load time
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


def parse_bytes(value: int | float | str) -> int:
    """'2GiB', '512MB', '1e9' or a number of bytes -> bytes."""
    if isinstance(value, (int, float)):
        num_bytes = int(value)
    else:
        match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", value)
        unit = match.group(2).lower() if match else None
        if not match or unit not in _UNITS:
            raise ValueError(f"cannot parse memory size {value!r}; use e.g. 2GiB, 512MB or a byte count")
        num_bytes = int(float(match.group(1)) * _UNITS[unit])
    if num_bytes <= 0:
        raise ValueError(f"memory size must be positive, got {value!r}")
    return num_bytes


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which model to run and in what precision. model=None means the default model."""

    model: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    # quantize a float checkpoint at load time (w8a16, w4a16, w8a8, fp8), or keep a GGUF file's
    # Q8_0/Q4_0/Q4_1 linear weights quantized instead of dequantizing them (gguf)
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache: block size, byte budget (None = automatic), prefix caching, and what a cached key
    or value is stored as: the model dtype ("auto"), or int8 / fp8 codes with a scale per token and head."""

    block_size: int = 16
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"block_size must be a power of two in [1, 256], got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """One token budget per step shared by decodes and prefill chunks."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Ranks that split each layer (tensor parallel) times stages that split the layer stack."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    """device: 'auto', 'cpu', 'cuda' or 'cuda:N'; attention_backend: 'auto', 'torch' or 'triton'."""

    device: str = "auto"
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    seed: int = 0
