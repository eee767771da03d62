"""What a prompt may be (text, token ids, or a dict with either) and its token ids."""

from __future__ import annotations

from kvforge.tokenizer import Tokenizer

PromptType = str | list[int] | dict


def tokenize_prompt(tokenizer: Tokenizer, vocab_size: int, prompt: PromptType) -> tuple[str | None, list[int]]:
    """(the text, or None for token ids; the token ids). Token ids must lie in [0, vocab_size)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            prompt = list(prompt["prompt_token_ids"])
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in prompt):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
    return None, list(prompt)
