"""best_of: generate more completions than asked for and return the n most likely (the highest cumulative
logprob), as OpenAI's completions API did."""

from __future__ import annotations

import dataclasses

from kvforge.outputs import CompletionOutput, RequestOutput
from kvforge.server.errors import APIError
from kvforge.server.protocol import CompletionRequest


def num_candidates(body: CompletionRequest) -> int:
    """Completions to generate per prompt: best_of (n when not given); 400 for fewer than n, or for more than n
    streamed (only the finished completions can be ranked)."""
    if body.best_of is None or body.best_of == body.n:
        return body.n
    if body.best_of < body.n:
        raise APIError(400, f"best_of must be >= n, got best_of={body.best_of} and n={body.n}", param="best_of")
    if body.stream:
        raise APIError(400, "best_of greater than n cannot be streamed: the best completions are known only once "
                            "all have finished; ask without stream", param="best_of")
    return body.best_of


def best_completions(output: RequestOutput, n: int) -> RequestOutput:
    """output with only its n completions of the highest cumulative logprob, most likely first and re-indexed
    0..n-1. Each completion needs its sampled tokens' logprobs (SamplingParams.logprobs=0 or more)."""
    ranked = sorted(output.outputs, key=_cumulative_logprob, reverse=True)[:n]
    return dataclasses.replace(output, outputs=[dataclasses.replace(c, index=i) for i, c in enumerate(ranked)])


def _cumulative_logprob(completion: CompletionOutput) -> float:
    assert completion.logprobs is not None, "best_of ranks completions by their tokens' logprobs"
    return sum(position[token_id].logprob
               for token_id, position in zip(completion.token_ids, completion.logprobs, strict=True))
