"""The `tokenizers` backend that a GGUF file's `tokenizer.*` metadata describes.

    tokenizer.ggml.model "gpt2"   byte-level BPE: the tokens, their merges and a pre-tokenizer named by
                                  `tokenizer.ggml.pre` (the regexes below)
    tokenizer.ggml.model "llama"  SentencePiece BPE (Llama 2, Mistral 7B, Mixtral, Gemma): the tokens and their
                                  scores; spaces are written "▁" and one goes before each run of text (unless
                                  `tokenizer.ggml.add_space_prefix` is false), the two pieces whose merge scores
                                  highest merge first, and a character no piece spells is written as its UTF-8
                                  bytes' <0xXX> tokens

In both, CONTROL tokens are special and matched whole, USER_DEFINED ones matched whole as plain text.
"""

from __future__ import annotations

import logging
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

logger = logging.getLogger(__name__)

# GGUF `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_UNKNOWN = 2
_TOKEN_TYPE_USER_DEFINED = 4

# The regexes each `tokenizer.ggml.pre` value splits text with, applied in order before the
# byte-level mapping. They follow llama.cpp's pre-tokenizer table, which copies each model's
# `tokenizer.json`. NOTE: "smollm" first isolates every numeral (\p{N}), as SmolLM2's tokenizer.json
# does with Digits(individual_digits) before ByteLevel. That changes ids wherever whitespace
# precedes a numeral: "  1" -> ["ĠĠ", "1"] (GPT-2 split: ["Ġ", "Ġ", "1"]), " ½" -> ["Ġ", "Â½"].
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (GPT-4o, GPT-OSS): words keep a leading non-letter and their case run, contractions attach, numerals in threes
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5: Qwen2's, with combining marks kept with their letters
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("default", "gpt2", "gpt-2", "mpt", "olmo"), (_GPT2_SPLIT,)),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"),
        (r"\p{N}", _GPT2_SPLIT),
    ),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "smaug-bpe"), (_LLAMA3_SPLIT,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), (_QWEN2_SPLIT,)),
    "tekken": (_TEKKEN_SPLIT,),
    **dict.fromkeys(("gpt-4o", "llama4"), (_GPT4O_SPLIT,)),
    "qwen35": (_QWEN35_SPLIT,),
}


_TOKEN_TYPE_NORMAL = 1
_SPACE = "\u2581"  # how SentencePiece writes a space


def gguf_backend(meta: dict[str, Any]) -> tokenizers.Tokenizer:
    """The backend of the `tokenizer.*` metadata meta (without its BOS/EOS post-processor); ValueError naming an
    unsupported tokenizer model or inconsistent metadata."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens", [])
    if kind not in ("gpt2", "llama"):
        raise ValueError(f"unsupported GGUF tokenizer model tokenizer.ggml.model={kind!r}; "
                         "only 'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE) are supported")
    if not tokens:
        raise ValueError("GGUF file has no tokenizer.ggml.tokens")
    token_types = meta.get("tokenizer.ggml.token_type")
    if token_types is not None and len(token_types) != len(tokens):
        raise ValueError(f"GGUF has {len(tokens)} tokens but {len(token_types)} token types")
    if kind == "gpt2":
        backend = _byte_level_bpe(tokens, meta.get("tokenizer.ggml.merges", []))
        backend.pre_tokenizer = _gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ValueError(f"a SentencePiece GGUF tokenizer needs one tokenizer.ggml.scores value per token "
                             f"({len(tokens)}), got {None if scores is None else len(scores)}")
        types = token_types or [_TOKEN_TYPE_NORMAL] * len(tokens)
        backend = _sentencepiece_bpe(tokens, scores, types, meta.get("tokenizer.ggml.add_space_prefix", True))
    if token_types is not None:
        _add_typed_tokens(backend, tokens, token_types)
    return backend


def _sentencepiece_bpe(tokens: list[str], scores: list[float], token_types: list[int],
                       add_space_prefix: bool) -> tokenizers.Tokenizer:
    """SentencePiece's BPE as ranked merges: a piece's every split into two pieces is a merge, ranked by the piece's
    score (higher first; ties by the piece's id)."""
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    ranked = []
    for token_id, (token, score, kind) in enumerate(zip(tokens, scores, token_types, strict=True)):
        if kind != _TOKEN_TYPE_NORMAL:
            continue
        ranked.extend((-score, token_id, token[:i], token[i:]) for i in range(1, len(token))
                      if token[:i] in vocab and token[i:] in vocab)
    ranked.sort()
    unk = next((t for t, kind in zip(tokens, token_types, strict=True) if kind == _TOKEN_TYPE_UNKNOWN), None)
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[(left, right) for *_, left, right in ranked],
                                              unk_token=unk, fuse_unk=True, byte_fallback=True))
    spaces = [normalizers.Prepend(_SPACE)] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*spaces, normalizers.Replace(" ", _SPACE)])
    strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    backend.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *strip])
    return backend


def _byte_level_bpe(tokens: list[str], merges: list[str]) -> tokenizers.Tokenizer:
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    backend.decoder = decoders.ByteLevel()
    return backend


def _add_typed_tokens(backend: tokenizers.Tokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Match CONTROL (special) and USER_DEFINED (plain) tokens whole in the text, as llama.cpp does."""
    typed = list(zip(tokens, token_types, strict=True))
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in typed if k == _TOKEN_TYPE_CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in typed if k == _TOKEN_TYPE_USER_DEFINED]
    )


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    splits = _PRE_TOKENIZER_SPLITS.get(pre)
    if splits is None:
        logger.warning("unknown GGUF pre-tokenizer %r; splitting text the GPT-2 way", pre)
        splits = (_GPT2_SPLIT,)
    steps = [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in splits]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return pre_tokenizers.Sequence([*steps, byte_level])
