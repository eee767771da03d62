"""What generation returns: RequestOutput holding one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """The log-probability of one token, its rank in the distribution (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob (the top k and always the actual token).
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request: its text so far, its tokens and why it stopped (None while running)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A request's outputs; `finished` once every sample has stopped."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class PoolingOutput:
    """What a pooling model returned for one input: an embedding, class probabilities or a relevance score.

    data: a float32 CPU tensor of one dimension (embedding values, or one probability per class)."""

    data: object  # torch.Tensor; kept untyped so this module stays free of torch

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()

    @property
    def probs(self) -> list[float]:
        return self.data.tolist()

    @property
    def score(self) -> float:
        """The relevance score: the probability of the first class (a one-logit head's sigmoid)."""
        return float(self.data[0])


@dataclass(slots=True)
class PoolingRequestOutput:
    """One input's pooling output; finished from the start (a pooling request takes one step)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
