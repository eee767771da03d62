"""Statistics of every quantizable layer's inputs over calibration text, gathered with forward hooks
while the engine scores the text (so the model runs exactly as it serves)."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources

import torch

from kvforge.engine.llm_engine import LLMEngine
from kvforge.layers.linear import Linear

MAX_SAMPLED_ROWS = 512  # input rows kept per layer for AWQ's scale search


def default_calibration_text() -> str:
    return resources.files("kvforge.data").joinpath("calibration.txt").read_text()


def calibration_sequences(engine: LLMEngine, text: str, seq_len: int, num_seqs: int) -> list[list[int]]:
    """Up to num_seqs token sequences of seq_len tokens (the last one may be shorter)."""
    token_ids = engine.tokenizer.encode(text)
    if len(token_ids) < 2:
        raise ValueError("the calibration text is too short (fewer than 2 tokens)")
    seq_len = min(seq_len, engine.max_model_len)
    return [token_ids[i : i + seq_len] for i in range(0, len(token_ids), seq_len)][:num_seqs]


@dataclass(slots=True)
class InputStats:
    """hessian: sum of x x^T (GPTQ); abs_sum / abs_max: per input feature (AWQ, SmoothQuant);
    rows: a sample of inputs (AWQ's loss)."""

    hessian: torch.Tensor | None
    abs_sum: torch.Tensor
    abs_max: torch.Tensor
    rows: list[torch.Tensor] = field(default_factory=list)
    num_tokens: int = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()  # [num_tokens, in_features]
        if self.hessian is not None:
            self.hessian += x.t() @ x
        self.abs_sum += x.abs().sum(dim=0)
        self.abs_max = torch.maximum(self.abs_max, x.abs().amax(dim=0))
        kept = sum(r.shape[0] for r in self.rows)
        if kept < MAX_SAMPLED_ROWS:
            self.rows.append(x[: MAX_SAMPLED_ROWS - kept].clone())
        self.num_tokens += x.shape[0]

    def mean_hessian(self) -> torch.Tensor:
        return 2 * self.hessian / max(self.num_tokens, 1)

    def sampled_rows(self) -> torch.Tensor:
        return torch.cat(self.rows)


def collect_input_stats(
    engine: LLMEngine, layers: dict[str, Linear], sequences: list[list[int]], with_hessian: bool
) -> dict[str, InputStats]:
    """Score every sequence once; return the input statistics of each named layer."""
    stats = {
        name: InputStats(
            torch.zeros(layer.in_features, layer.in_features) if with_hessian else None,
            torch.zeros(layer.in_features),
            torch.zeros(layer.in_features),
        )
        for name, layer in layers.items()
    }
    handles = [
        layer.register_forward_pre_hook(lambda _, args, s=stats[name]: s.add(args[0]))
        for name, layer in layers.items()
    ]
    try:
        for token_ids in sequences:
            engine.score(token_ids)
    finally:
        for handle in handles:
            handle.remove()
    return stats
