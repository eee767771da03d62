"""Grammars on the tiny model's tokenizer: compilation and its cache, errors, the matcher's bitmask (EOS
exactly when the output is complete), rollback, and the sampler applying the bitmask first."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvforge.layers.sampler import Sampler, apply_token_bitmask
from kvforge.structured_output.bitmask import GrammarBitmask
from kvforge.structured_output.compiler import GrammarCompiler
from kvforge.structured_output.params import StructuredOutputParams
from kvforge.tokenizer import Tokenizer
from tests.layers.test_sampler import _batch


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: tuple[Path, object]) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir[0])


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer):
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size + 5)  # logits wider than the vocabulary
    yield compiler
    compiler.shutdown()


def _allowed(matcher, num_words: int) -> set[int]:
    bitmask = GrammarBitmask.build([("r", matcher)], num_words).bitmask
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def test_equal_constraints_share_one_compilation(compiler: GrammarCompiler) -> None:
    first = compiler.compile(StructuredOutputParams(json={"type": "object", "required": ["a"]}))
    same = compiler.compile(StructuredOutputParams(json='{"required": ["a"], "type": "object"}'))
    assert same is first
    assert compiler.compile(StructuredOutputParams(regex="[ab]+")) is not first


@pytest.mark.parametrize(("params", "words"), [
    (StructuredOutputParams(grammar='root ::= "a" ('), "grammar cannot be compiled"),
    (StructuredOutputParams(regex="(a"), "regex cannot be compiled"),
    (StructuredOutputParams(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
])
def test_bad_grammars_fail_with_a_reason(compiler: GrammarCompiler, params: StructuredOutputParams,
                                         words: str) -> None:
    with pytest.raises(ValueError, match=words):
        compiler.compile(params).result()


@pytest.mark.parametrize("kwargs", [{}, {"regex": "a", "choice": ["b"]}, {"choice": []}, {"json": "{oops"},
                                    {"json": [1]}, {"regex": " "}])
def test_bad_params_are_value_errors(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        StructuredOutputParams(**kwargs)


def test_eos_is_allowed_exactly_when_the_output_is_complete(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    matcher = compiler.compile(StructuredOutputParams(regex="[0-9]{2,3}")).result().matcher()
    eos = tokenizer.eos_token_id
    digit = tokenizer.encode("7", add_special_tokens=False)
    assert len(digit) == 1
    complete = []
    for _ in range(3):
        assert matcher.advance(digit) == 1
        complete.append(eos in _allowed(matcher, compiler.bitmask_words))
    assert complete == [False, True, True]
    assert matcher.is_terminated and _allowed(matcher, compiler.bitmask_words) == {eos}
    assert matcher.advance(digit) == 0  # nothing but the end follows


def test_rollback_returns_to_the_earlier_mask(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    matcher = compiler.compile(StructuredOutputParams(choice=["cat", "dog"])).result().matcher()
    start = _allowed(matcher, compiler.bitmask_words)
    token_ids = tokenizer.encode("dog", add_special_tokens=False)
    assert matcher.advance(token_ids) == len(token_ids) and matcher.is_complete
    matcher.rollback(len(token_ids))
    assert _allowed(matcher, compiler.bitmask_words) == start and not matcher.is_complete
    assert matcher.advance(tokenizer.encode("cow", add_special_tokens=False)) < 3


def test_the_sampler_applies_the_bitmask_before_anything_else() -> None:
    vocab = 70
    logits = torch.randn(3, vocab)
    logits[:, 0] = 50.0  # the favourite, allowed in row 2 only
    bitmask = np.zeros((3, 3), dtype=np.int32)
    bitmask[0, 1] = 1 << 3  # token 35
    bitmask[1, 2] = (1 << 1) | (1 << 4)  # tokens 65 and 68
    bitmask[2] = -1
    masked = apply_token_bitmask(logits, torch.from_numpy(bitmask))
    assert torch.isfinite(masked).sum(dim=1).tolist() == [1, 2, vocab]
    sampler = Sampler()
    batch = _batch(3, temperatures=[1.0, 1.5, 0.0], top_ks=[5, -1, -1], repetition_penalties=[1.3, 1.0, 1.0],
                   prompt_token_ids=[[35], [], []], allowed_token_bitmask=torch.from_numpy(bitmask))
    for _ in range(20):
        token_ids, _ = sampler(logits, batch)
        assert token_ids[0] == 35 and token_ids[1] in (65, 68) and token_ids[2] == 0


@pytest.mark.parametrize(("params", "text"), [
    (StructuredOutputParams(json={"type": "object", "required": ["a", "b", "c"], "properties": {
        "a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "boolean"}},
        "c": {"type": "object", "properties": {"d": {"type": "number"}}, "required": ["d"]}}}),
     '{"a": 1, "b": [true, false], "c": {"d": 2.5}}'),
    (StructuredOutputParams(json_object=True), '{"k": [1, {"x": null}], "y": "a  b"}'),
])
def test_json_output_cannot_pad_with_whitespace(compiler: GrammarCompiler, tokenizer: Tokenizer,
                                                params: StructuredOutputParams, text: str) -> None:
    """Outside strings, no token may start a run of whitespace or a line break: the one space after ':' and ','
    is all the whitespace a constrained model can write, so it cannot spend its tokens on padding."""
    matcher = compiler.compile(params).result().matcher()
    texts = [tokenizer.decode([t], skip_special_tokens=False) for t in range(tokenizer.vocab_size)]
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    for i, token_id in enumerate(token_ids):
        before = tokenizer.decode(token_ids[:i])
        if before.count('"') % 2 == 0:  # between JSON tokens, not in a string
            padding = [texts[t] for t in _allowed(matcher, compiler.bitmask_words)
                       if t < len(texts) and ("  " in before[-1:] + texts[t] or any(c in texts[t] for c in "\n\r\t"))]
            assert not padding, f"after {before!r} the grammar allows {padding}"
        assert matcher.advance([token_id]) == 1
    assert matcher.is_complete


def test_a_grammar_after_a_marker_starts_once_the_marker_is_written(compiler: GrammarCompiler,
                                                                     tokenizer: Tokenizer) -> None:
    compiled = compiler.compile(StructuredOutputParams(choice=["cat", "dog"])).result()
    words = compiler.bitmask_words
    start = _allowed(compiled.matcher(), words)
    matcher = compiled.matcher(starts_after="</think>")
    free = _allowed(matcher, words)
    reasoning = tokenizer.encode("The quick fox </think>", add_special_tokens=False)
    assert len(tokenizer.encode("</think>", add_special_tokens=False)) > 1  # the marker spans tokens
    for token_id in reasoning[:-1]:
        assert matcher.advance([token_id]) == 1 and _allowed(matcher, words) == free
        assert not matcher.is_complete and not matcher.is_terminated
    assert matcher.advance(reasoning[-1:]) == 1 and _allowed(matcher, words) == start
    dog = tokenizer.encode("dog", add_special_tokens=False)
    assert matcher.advance(dog) == len(dog) and matcher.is_complete
    matcher.rollback(len(dog) + 1)  # back before the marker's last token: free again
    assert _allowed(matcher, words) == free
    assert matcher.advance(reasoning[-1:] + dog) == 1 + len(dog) and matcher.is_terminated
