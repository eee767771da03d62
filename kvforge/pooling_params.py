"""PoolingParams: what a pooling model returns for one input (validated in __post_init__)."""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TASKS = ("embed", "classify", "score")


@dataclass(slots=True)
class PoolingParams:
    """Per-request settings of a pooling model (runner "pooling").

    task: "embed" (the pooled hidden state), "classify" (the class probabilities of the model's classifier head)
    or "score" (a cross-encoder's relevance of a query and document pair). dimensions: keep the first
    `dimensions` values of an embedding (Matryoshka models), before normalisation. normalize: scale an embedding
    to unit length (None: as the checkpoint says, e.g. sentence-transformers' Normalize module).
    truncate_prompt_tokens: keep the last k tokens of a longer input instead of refusing it (-1: as many as the
    model's window holds)."""

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {POOLING_TASKS}, got {self.task!r}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ValueError(f"dimensions must be an integer >= 1, got {self.dimensions!r}")
        if self.dimensions is not None and self.task != "embed":
            raise ValueError(f"dimensions applies to embeddings only, not to task {self.task!r}")
        truncate = self.truncate_prompt_tokens
        if truncate is not None and (not isinstance(truncate, int) or truncate < 1) and truncate != -1:
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1, or -1 (the model's window), got "
                             f"{truncate!r}")

    @property
    def n(self) -> int:
        """Sequences per input, as the engine's admission counts them: always one."""
        return 1
