"""What completions and chat completions share of logprobs: a token's name, and vLLM's `prompt_logprobs`."""

from __future__ import annotations

from kvforge.outputs import PositionLogprobs
from kvforge.server.protocol import PromptLogprob, PromptLogprobs


def token_name(token_id: int, text: str, as_token_id: bool) -> str:
    """How logprobs name a token: its text, or `token_id:N` (return_tokens_as_token_ids), which says
    exactly which token it was where texts are ambiguous (bytes of a character, tokens of one text)."""
    return f"token_id:{token_id}" if as_token_id else text


def prompt_logprobs(positions: list[PositionLogprobs | None] | None) -> PromptLogprobs | None:
    """The engine's prompt logprobs as vLLM returns them: per prompt position (None for the first, which
    nothing predicts), the top tokens and the prompt's own, under their token ids."""
    if positions is None:
        return None
    return [None if position is None else
            {str(token_id): PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
             for token_id, lp in position.items()}
            for position in positions]
