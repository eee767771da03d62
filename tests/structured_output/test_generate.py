"""LLM.generate and LLM.chat under constraints on the tiny random model: whatever the random weights
prefer, every output follows its JSON schema (checked with `jsonschema`), regex or choice; max_tokens
cuts a constrained output with finish_reason "length"."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvforge.llm import LLM
from kvforge.sampling_params import SamplingParams
from kvforge.structured_output.params import StructuredOutputParams

# Schemas whose every instance is short, so a random model finishes each within max_tokens.
SCHEMAS = [
    {"type": "object", "properties": {"size": {"enum": ["S", "M", "L"]}, "pos": {  # nested, enum
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x"], "additionalProperties": False}}, "required": ["size", "pos"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3},  # array with minItems
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 5}},  # bounded number
     "required": ["n"], "additionalProperties": False},
    {"type": "string", "pattern": "^[a-c]{2}-[0-9]$"},  # a string with a pattern
]


def test_outputs_follow_their_schemas(tiny_llm: LLM) -> None:
    params = [SamplingParams(n=3, temperature=1.0, seed=i, max_tokens=40, guided_json=schema)
              for i, schema in enumerate(SCHEMAS)]
    outputs = tiny_llm.generate(["Answer:"] * len(SCHEMAS), params)
    for schema, output in zip(SCHEMAS, outputs):
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion.text
            jsonschema.validate(json.loads(completion.text), schema)


def test_regex_choice_and_grammar_hold_in_chat(tiny_llm: LLM) -> None:
    conversation = [{"role": "user", "content": "Pick one"}]
    constraints = [StructuredOutputParams(regex="[0-9]{3}-[a-z]{2,4}"),
                   StructuredOutputParams(choice=["red", "green", "blue"]),
                   StructuredOutputParams(grammar='root ::= ("yes" | "no") "!"')]
    checks = [lambda t: re.fullmatch("[0-9]{3}-[a-z]{2,4}", t), lambda t: t in ("red", "green", "blue"),
              lambda t: t in ("yes!", "no!")]
    for constraint, check in zip(constraints, checks):
        params = SamplingParams(n=4, temperature=1.2, seed=3, max_tokens=24, structured_output=constraint)
        (output,) = tiny_llm.chat(conversation, params)
        assert all(check(c.text) and c.finish_reason == "stop" for c in output.outputs), output.outputs


def test_keys_come_in_the_schemas_order_and_no_others(tiny_llm: LLM) -> None:
    """Properties are generated in the order the schema lists them (not sorted), and an object whose schema does not
    open it to other keys gets none (the model may not invent a key)."""
    schema = {"type": "object", "properties": {"reasoning": {"enum": ["a", "b"]}, "answer": {"type": "boolean"}},
              "required": ["reasoning", "answer"]}
    params = SamplingParams(n=4, temperature=1.2, seed=5, max_tokens=48, guided_json=schema)
    for completion in tiny_llm.generate("Answer:", params)[0].outputs:
        assert completion.finish_reason == "stop", completion.text
        assert list(json.loads(completion.text)) == ["reasoning", "answer"]
    opened = {**schema, "required": ["answer"], "additionalProperties": {"type": "integer"}}
    source = StructuredOutputParams(json=opened).grammar_source()[1]
    assert json.loads(source)["additionalProperties"] == {"type": "integer"}


def test_max_tokens_cuts_with_length(tiny_llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=2, guided_json=SCHEMAS[0])
    completion = tiny_llm.generate("Answer:", params)[0].outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 2
    assert completion.text.startswith("{")


def test_constrained_and_free_requests_share_a_batch(tiny_llm: LLM) -> None:
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = tiny_llm.generate("The quick brown fox", free)[0].outputs[0].text
    mixed = tiny_llm.generate(["The quick brown fox", "Answer:"],
                              [free, SamplingParams(temperature=0, max_tokens=12, guided_choice=["x", "y"])])
    assert mixed[0].outputs[0].text == alone and mixed[1].outputs[0].text in ("x", "y")


def test_a_bad_grammar_is_a_value_error_and_nothing_runs(tiny_llm: LLM) -> None:
    with pytest.raises(ValueError, match="uniqueItems"):
        tiny_llm.generate(["a", "b"], [SamplingParams(max_tokens=4),
                                       SamplingParams(guided_json={"type": "array", "uniqueItems": True})])
    assert not tiny_llm.engine.has_unfinished_requests()
