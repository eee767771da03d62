"""Which torch device the engine runs on."""

from __future__ import annotations

import torch

from kvforge.config import DeviceConfig


def resolve_device(config: DeviceConfig) -> torch.device:
    """'auto' takes the first GPU (CUDA or ROCm, which torch both calls cuda) when there is one."""
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {config.device!r} requested but no CUDA/ROCm GPU is available")
    return device
