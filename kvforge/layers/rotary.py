"""Rotary position embedding: the cos/sin table (with rope scaling) and the module applying it."""

from __future__ import annotations

import math

import torch
from torch import nn

from kvforge.kernels.ops import current_ops


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    is_medium = (wavelen <= low_freq_wavelen) & (wavelen >= high_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for attention over a context stretched by factor."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(inv_freq: torch.Tensor, rot_dim: int, base: float, scaling: dict) -> torch.Tensor:
    """YaRN: frequencies that turn more than beta_fast times over the original context are kept, those
    turning fewer than beta_slow times are slowed by `factor`, with a linear ramp over the dims between."""
    factor = scaling["factor"]
    old_context = scaling["original_max_position_embeddings"]

    def dim_of(turns: float) -> float:  # the dim whose frequency turns `turns` times over old_context
        return rot_dim * math.log(old_context / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def _yarn_attention_factor(scaling: dict) -> float:
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    factor, mscale, mscale_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def build_cos_sin_cache(
    rot_dim: int, max_position: int, base: float, rope_scaling: dict | None
) -> torch.Tensor:
    """[max_position, rot_dim] fp32: cos of every (position, frequency) then sin."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    positions = torch.arange(max_position, dtype=torch.float64)
    magnitude = 1.0
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
    elif rope_type == "linear":
        positions = positions / rope_scaling["factor"]
    elif rope_type == "yarn":
        inv_freq = _yarn_inv_freq(inv_freq, rot_dim, base, rope_scaling)
        magnitude = _yarn_attention_factor(rope_scaling)
    elif rope_type != "default":
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}")
    freqs = torch.outer(positions, inv_freq)
    return (torch.cat((freqs.cos(), freqs.sin()), dim=-1) * magnitude).float()


class RotaryEmbedding(nn.Module):
    """Applies rotary embedding to queries and keys at the given positions."""

    def __init__(
        self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None, is_neox: bool = True
    ) -> None:
        super().__init__()
        self.is_neox = is_neox
        self.ops = current_ops()
        cache = build_cos_sin_cache(head_dim, max_position, base, rope_scaling)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rotary_embedding(positions, query, key, self.cos_sin_cache, self.is_neox)


def keep_positions(model: nn.Module, num_positions: int) -> None:
    """Cut every rotary table of the model to its first num_positions rows, in a copy of their own (the longer table
    is freed), where no token of the engine's ever reaches a later position.

    NOTE: a table holds the model's every position (131072 of a Llama 3: 32 MiB in float32) while its engine's KV
    cache may hold a few thousand tokens; a 256 MiB cache of a 1B model, 8192 tokens: 2 MiB of table."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding) and module.cos_sin_cache.shape[0] > num_positions:
            module.cos_sin_cache = module.cos_sin_cache[:num_positions].clone()
