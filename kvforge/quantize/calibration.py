"""Calibration text, the token sequences sampled from it, and the statistics of every quantizable
layer's inputs over them.

The shipped calibration set (kvforge/data/calibration/, ~80k tokens of prose, technical writing, code,
markup and dialogue; kvforge/data/SOURCES.md has the sources and licences) is what `kvforge quantize`
uses unless files are given. Sequences start at seeded random token positions of the joined texts."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from kvforge.engine.llm_engine import LLMEngine
from kvforge.layers.linear import Linear

MAX_SAMPLED_ROWS = 2048  # input rows kept per layer for AWQ's searches, spread over all sequences


def default_calibration_texts() -> list[str]:
    """The shipped calibration set, one text per file."""
    folder = resources.files("kvforge.data").joinpath("calibration")
    return [entry.read_text(encoding="utf-8") for entry in sorted(folder.iterdir(), key=lambda e: e.name)
            if entry.name.endswith(".txt")]  # fmt: skip


def read_calibration_files(paths: list[str]) -> list[str]:
    """The texts of the files a user passed (--calibration, repeatable)."""
    for path in paths:
        if not Path(path).is_file():
            raise ValueError(f"calibration file {path!r} not found")
    return [Path(path).read_text(encoding="utf-8") for path in paths]


def calibration_sequences(
    token_ids: list[int], seq_len: int, num_seqs: int, seed: int = 0
) -> list[list[int]]:
    """num_seqs windows of seq_len tokens starting at seeded random positions (distinct where the text
    has room; the whole text once if it is shorter than one window)."""
    if len(token_ids) < 2:
        raise ValueError("the calibration text is too short (fewer than 2 tokens)")
    if len(token_ids) <= seq_len:
        return [token_ids]
    rng = random.Random(seed)
    num_starts = len(token_ids) - seq_len + 1
    starts = rng.sample(range(num_starts), num_seqs) if num_seqs <= num_starts else rng.choices(
        range(num_starts), k=num_seqs)  # fmt: skip
    return [token_ids[start : start + seq_len] for start in sorted(starts)]


def tokenize_texts(engine: LLMEngine, texts: list[str]) -> list[int]:
    """All texts as one token stream, each text starting with the beginning-of-text token if any."""
    token_ids: list[int] = []
    for text in texts:
        token_ids.extend(engine.tokenizer.encode(text))
    return token_ids


@dataclass(slots=True)
class InputStats:
    """hessian: sum of x x^T in float64 (GPTQ); abs_sum / abs_max: per input feature (AWQ, SmoothQuant);
    rows: inputs sampled at random from every call (AWQ's losses)."""

    hessian: torch.Tensor | None
    abs_sum: torch.Tensor
    abs_max: torch.Tensor
    rows_per_call: int
    generator: torch.Generator
    rows: list[torch.Tensor] = field(default_factory=list)
    num_tokens: int = 0

    @classmethod
    def empty(cls, in_features: int, with_hessian: bool, num_calls: int, seed: int = 0) -> InputStats:
        hessian = torch.zeros(in_features, in_features, dtype=torch.float64) if with_hessian else None
        return cls(hessian, torch.zeros(in_features), torch.zeros(in_features),
                   max(1, MAX_SAMPLED_ROWS // max(num_calls, 1)), torch.Generator().manual_seed(seed))  # fmt: skip

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()  # [num_tokens, in_features]
        if self.hessian is not None:
            self.hessian += (x.t() @ x).double()  # NOTE: float32 within a call, float64 across calls
        self.abs_sum += x.abs().sum(dim=0)
        self.abs_max = torch.maximum(self.abs_max, x.abs().amax(dim=0))
        picked = torch.randperm(x.shape[0], generator=self.generator)[: self.rows_per_call]
        self.rows.append(x[picked].clone())
        self.num_tokens += x.shape[0]

    def mean_hessian(self) -> torch.Tensor:
        return 2 * self.hessian / max(self.num_tokens, 1)

    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / max(self.num_tokens, 1)

    def sampled_rows(self) -> torch.Tensor:
        return torch.cat(self.rows)


def collect_input_stats(
    engine: LLMEngine, layers: dict[str, Linear], sequences: list[list[int]], with_hessian: bool
) -> dict[str, InputStats]:
    """Score every sequence once through the whole model; return the input statistics of each layer."""
    stats = {name: InputStats.empty(layer.in_features, with_hessian, len(sequences))
             for name, layer in layers.items()}  # fmt: skip
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
