"""Mixture-of-experts routing: which top_k experts each token goes to, and with what weight.

Two scorings cover the supported families:

    softmax (Mixtral, Qwen-MoE, DeepSeek-V2)   weights = softmax(logits), top_k of them
    sigmoid (DeepSeek-V3)                      weights = sigmoid(logits); the choice uses
                                               sigmoid(logits) + e_score_correction_bias

Grouped routing (DeepSeek) first keeps the topk_groups best of num_groups equal groups of experts, a
group scored by its best expert ("max", V2) or the sum of its two best ("top2_sum", V3), and picks the
top_k experts among those groups only. Then, optionally, the weights are renormalized to sum to 1, and
scaled by routed_scaling_factor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

_SCORINGS = ("softmax", "sigmoid")
_GROUP_SCORES = ("max", "top2_sum")


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    num_experts: int
    top_k: int
    scoring: str = "softmax"
    renormalize: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False  # DeepSeek-V3's e_score_correction_bias
    logit_bias: bool = False  # GPT-OSS: the gate is a linear layer with a bias

    def __post_init__(self) -> None:
        if self.scoring not in _SCORINGS:
            raise ValueError(f"scoring must be one of {_SCORINGS}, got {self.scoring!r}")
        if self.group_score not in _GROUP_SCORES:
            raise ValueError(f"group_score must be one of {_GROUP_SCORES}, got {self.group_score!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ValueError(f"num_groups ({self.num_groups}) must divide num_experts ({self.num_experts})")
        if not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_groups must be in [1, {self.num_groups}], got {self.topk_groups}")
        if self.top_k > self.topk_groups * self.num_experts // self.num_groups:
            raise ValueError(
                f"top_k ({self.top_k}) exceeds the {self.topk_groups} kept groups of "
                f"{self.num_experts // self.num_groups} experts"
            )
        if self.group_score == "top2_sum" and self.num_groups > 1 and self.num_experts // self.num_groups < 2:
            raise ValueError("group_score 'top2_sum' needs at least 2 experts per group")


def _keep_best_groups(choice: torch.Tensor, cfg: RoutingConfig) -> torch.Tensor:
    """choice: [num_tokens, num_experts]; -inf outside each token's topk_groups best groups."""
    groups = choice.view(choice.shape[0], cfg.num_groups, -1)  # [num_tokens, num_groups, per_group]
    if cfg.group_score == "max":
        group_scores = groups.max(dim=-1).values
    else:
        group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
    best = group_scores.topk(cfg.topk_groups, dim=-1, sorted=False).indices
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return groups.masked_fill(~kept[..., None], float("-inf")).view_as(choice)


def select_experts(
    router_logits: torch.Tensor, cfg: RoutingConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [num_tokens, num_experts]. Returns (topk_weights [num_tokens, top_k] fp32,
    topk_ids [num_tokens, top_k] int64)."""
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if cfg.scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if cfg.num_groups > 1 and cfg.topk_groups < cfg.num_groups:
        choice = _keep_best_groups(choice, cfg)
    topk_ids = choice.topk(cfg.top_k, dim=-1, sorted=False).indices
    topk_weights = scores.gather(1, topk_ids)
    if cfg.renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    if cfg.routed_scaling_factor != 1.0:
        topk_weights = topk_weights * cfg.routed_scaling_factor
    return topk_weights, topk_ids


class Router(nn.Module):
    """The gate of an MoE layer: logits = x W^T (+ b) in fp32 (W: [num_experts, hidden], kept in fp32 as the
    checkpoints' routers are), then select_experts."""

    def __init__(self, hidden_size: int, cfg: RoutingConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden_size, dtype=torch.float32),
                                   requires_grad=False)  # fmt: skip
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32), requires_grad=False)
            if cfg.correction_bias
            else None
        )
        self.bias = (nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32), requires_grad=False)
                     if cfg.logit_bias else None)  # fmt: skip

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [num_tokens, hidden] -> (topk_weights, topk_ids), both [num_tokens, top_k]."""
        logits = F.linear(x.float(), self.weight, self.bias)
        return select_experts(logits, self.cfg, self.e_score_correction_bias)
