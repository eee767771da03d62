"""Fill-in-the-middle: the prompt that asks a code model for the text between a prefix and a suffix."""

from __future__ import annotations

from kvforge.tokenizer import Tokenizer

# The (prefix, suffix, middle) marker tokens of the FIM formats models are trained on; a prompt puts them in
# prefix-suffix-middle order, and the model writes the middle after the last one.
FIM_MARKERS: tuple[tuple[str, str, str], ...] = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder, ...
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3, CodeGemma, ...
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)


def fill_in_middle_prompt(tokenizer: Tokenizer, prefix: str, suffix: str) -> str:
    """The prompt text for the middle between prefix and suffix, in the first of FIM_MARKERS whose three tokens
    the vocabulary has; ValueError when it has none (the model was not trained to fill in the middle)."""
    for markers in FIM_MARKERS:
        if all(tokenizer.backend.token_to_id(marker) is not None for marker in markers):
            prefix_marker, suffix_marker, middle_marker = markers
            return f"{prefix_marker}{prefix}{suffix_marker}{suffix}{middle_marker}"
    names = ", ".join(" ".join(markers) for markers in FIM_MARKERS)
    raise ValueError(f"suffix needs a model trained to fill in the middle, and this model's vocabulary has none "
                     f"of the fill-in-the-middle tokens ({names})")
