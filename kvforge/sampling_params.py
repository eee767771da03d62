"""SamplingParams: how to pick tokens and when to stop, validated on construction."""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field
from typing import Any

from kvforge.structured_output.params import StructuredOutputParams

# The largest |bias| logit_bias may add to a token's logit (the OpenAI API's bound).
MAX_LOGIT_BIAS = 100.0


@dataclass(slots=True)
class SamplingParams:
    """Per-request decoding settings, in the conventions of vLLM and the OpenAI API.

    temperature 0 means greedy. top_k <= 0 (or -1) disables top-k; top_p 1 and min_p 0 disable theirs.
    logprobs=k returns the k most likely tokens (plus the sampled one) per generated position;
    prompt_logprobs=k does the same for every prompt position after the first. max_tokens=0 runs the
    prompt and generates nothing (finish reason "length"): with prompt_logprobs, it scores the prompt.

    structured_output constrains the output to a JSON schema, a regex, a choice or a grammar (EOS is
    allowed exactly when the output is complete); guided_json, guided_regex, guided_choice and
    guided_grammar are vLLM's names for the same, folded into it. logit_bias maps token ids to a value
    in [-100, 100] added to their logits (after the constraint's mask).
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
    structured_output: StructuredOutputParams | None = None
    logit_bias: dict[int, float] | None = None
    guided_json: InitVar[dict[str, Any] | str | None] = None
    guided_regex: InitVar[str | None] = None
    guided_choice: InitVar[list[str] | None] = None
    guided_grammar: InitVar[str | None] = None

    def __post_init__(self, guided_json: dict[str, Any] | str | None = None, guided_regex: str | None = None,
                      guided_choice: list[str] | None = None, guided_grammar: str | None = None) -> None:
        self._fold_guided(guided_json, guided_regex, guided_choice, guided_grammar)
        self._check_logit_bias()
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
            (self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 0),
             f"max_tokens must be an integer >= 0, got {self.max_tokens!r}"),
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

    def _fold_guided(self, json: Any, regex: str | None, choice: list[str] | None, grammar: str | None) -> None:
        guided = {k: v for k, v in (("json", json), ("regex", regex), ("choice", choice), ("grammar", grammar))
                  if v is not None}
        if not guided:
            return
        if self.structured_output is not None or len(guided) > 1:
            names = [f"guided_{k}" for k in guided] + (["structured_output"] if self.structured_output else [])
            raise ValueError(f"give one output constraint, got {names}")
        self.structured_output = StructuredOutputParams(**guided)

    def _check_logit_bias(self) -> None:
        if not self.logit_bias:
            self.logit_bias = None
            return
        self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        bad = {k: v for k, v in self.logit_bias.items() if k < 0 or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS}
        if bad:
            raise ValueError(f"logit_bias needs token ids >= 0 and biases in [-100, 100], got {bad}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
