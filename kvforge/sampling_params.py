"""SamplingParams: how to pick tokens and when to stop, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    """Per-request decoding settings, in the conventions of vLLM and the OpenAI API.

    temperature 0 means greedy. top_k <= 0 (or -1) disables top-k; top_p 1 and min_p 0 disable theirs.
    logprobs=k returns the k most likely tokens (plus the sampled one) per generated position;
    prompt_logprobs=k does the same for every prompt position after the first.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        checks = [
            (isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}"),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k == -1 or 0 <= self.top_k < 2**31, f"top_k must be -1 (off) or in [0, 2**31), got {self.top_k}"),
            (self.seed is None or -(2**63) <= self.seed < 2**63, f"seed must be a 64-bit integer, got {self.seed}"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (-2.0 <= self.presence_penalty <= 2.0,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0.0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (self.max_tokens is None or self.max_tokens <= 10_000_000,
             f"max_tokens {self.max_tokens} is absurdly large"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"),
            (self.logprobs is None or 0 <= self.logprobs <= 20,
             f"logprobs must be in [0, 20], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}"),
            (all(isinstance(s, str) and s for s in self.stop), f"stop strings must be non-empty: {self.stop!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.top_k == 0:
            self.top_k = -1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
