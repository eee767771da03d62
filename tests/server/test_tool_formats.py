"""Tool-call formats (Hermes', Llama 3's JSON, Mistral's two): two calls parsed from every prefix of a reply only ever
grow toward the whole reply's calls, whose arguments json.loads reads back; the grammar admits two calls (after a
blank line) only with parallel_tool_calls, Mistral's [TOOL_CALLS] as its one special token; a chat template's format
is recognised."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken

from kvforge.server.protocol import FunctionDefinition
from kvforge.server.tool_formats import (
    HARMONY,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    MISTRAL_ARGS,
    CallFormat,
    call_format_of,
)
from kvforge.structured_output.compiler import GrammarCompiler
from kvforge.structured_output.params import StructuredOutputParams
from kvforge.tokenizer import Tokenizer

CALLS = [("get_weather", '{"city": "Paris", "days": [1, 2]}'), ("get_time", '{"zone": "a}b"}')]
TOOLS = [FunctionDefinition(name="get_weather", parameters={"type": "object"}),
         FunctionDefinition(name="get_time", parameters={"type": "object"})]


FORMATS = [HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_ARGS, HARMONY]


def _reply(call_format: CallFormat) -> str:
    return call_format.write_all(CALLS)


@pytest.mark.parametrize("call_format", FORMATS, ids=lambda f: f.name)
def test_calls_parsed_from_every_prefix_grow_to_the_whole(call_format: CallFormat) -> None:
    reply = _reply(call_format)
    assert call_format.parse(reply) == CALLS
    assert [json.loads(arguments) for _, arguments in CALLS]
    for cut in range(len(reply)):
        calls = call_format.parse(reply[:cut]) or []
        assert len(calls) <= len(CALLS)
        for (name, arguments), (final_name, final_arguments) in zip(calls, CALLS, strict=False):
            assert name == final_name and final_arguments.startswith(arguments), f"cut at {cut}"
        if not calls:  # undecided until the first name is whole
            assert call_format.may_become_call(reply[:cut])
    assert call_format.parse("\n" + reply) == CALLS and call_format.may_become_call("\n")
    assert call_format.parse("The weather is fine.") is None and not call_format.may_become_call("The weather")


@pytest.mark.parametrize("call_format", FORMATS, ids=lambda f: f.name)
def test_the_grammar_admits_two_calls_only_when_parallel(tiny_llama_dir: tuple[Path, object],
                                                         call_format: CallFormat) -> None:
    tokenizer = Tokenizer.from_dir(tiny_llama_dir[0])
    tokenizer.backend.add_special_tokens([AddedToken(token, special=True) for token in call_format.special_tokens])
    special_ids = {token: tokenizer.token_id(token) for token in call_format.special_tokens}
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    try:
        reply = _reply(call_format)
        token_ids = tokenizer.encode("\n\n" + reply, add_special_tokens=False)  # a blank line first
        assert all(special_ids[token] in token_ids for token in special_ids if token in reply)  # each one token
        one = tokenizer.encode("\n\n" + call_format.write_all(CALLS[:1]), add_special_tokens=False)
        for parallel in (True, False):
            grammar = call_format.grammar(TOOLS, allow_text=True, parallel=parallel, special_ids=special_ids)
            compiled = compiler.compile(StructuredOutputParams(grammar=grammar)).result()
            two_calls, one_call = compiled.matcher(), compiled.matcher()
            assert (two_calls.advance(token_ids) == len(token_ids)) == parallel
            assert two_calls.is_complete or not parallel
            assert one_call.advance(one) == len(one) and one_call.is_complete
            assert one_call.is_terminated or parallel  # without parallel: the first call, and nothing after it
    finally:
        compiler.shutdown()


def test_a_templates_call_format_is_recognised() -> None:
    llama31 = ('Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
               'value}.{% for tool in tools %}{{ tool | tojson }}{% endfor %}')
    qwen25 = '<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools> <tool_call>'
    assert call_format_of(llama31) is LLAMA3_JSON and call_format_of(qwen25) is HERMES
    mistral_v3 = '{{- "[TOOL_CALLS] [" }}{%- for tool_call in message.tool_calls %}'
    mistral_v11 = '{{- "[TOOL_CALLS]" + tool.function.name + "[ARGS]" + arguments }}'
    assert call_format_of(mistral_v3) is MISTRAL and call_format_of(mistral_v11) is MISTRAL_ARGS
    assert call_format_of("{{- '<|start|>assistant<|channel|>' + message.channel }}") is HARMONY


def test_harmonys_grammar_lets_an_analysis_come_first_and_a_final_message_be_the_text(
        tiny_llama_dir: tuple[Path, object]) -> None:
    tokenizer = Tokenizer.from_dir(tiny_llama_dir[0])
    tokenizer.backend.add_special_tokens([AddedToken(token, special=True) for token in HARMONY.special_tokens])
    special_ids = {token: tokenizer.token_id(token) for token in HARMONY.special_tokens}
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    analysis = "<|channel|>analysis<|message|>The user asks.<|end|><|start|>assistant"
    try:
        for allow_text, reply, whole in (
                (False, analysis + HARMONY.write_all(CALLS[:1]), True),
                (False, HARMONY.write_all(CALLS[:1]), True),
                (True, analysis + "<|channel|>final<|message|>It is sunny.", True),
                (False, analysis + "<|channel|>final<|message|>It is sunny.", False)):
            grammar = HARMONY.grammar(TOOLS, allow_text=allow_text, parallel=False, special_ids=special_ids)
            matcher = compiler.compile(StructuredOutputParams(grammar=grammar)).result().matcher()
            token_ids = tokenizer.encode(reply, add_special_tokens=False)
            assert (matcher.advance(token_ids) == len(token_ids) and matcher.is_complete) == whole, reply
        grammar = HARMONY.text_grammar({"type": "object", "properties": {"a": {"type": "integer"}}}, special_ids)
        for reply, whole in ((analysis + '<|channel|>final<|message|>{"a": 1}', True),
                             ('<|channel|>final<|message|>{"a": 1}', True),
                             (analysis + '<|channel|>final<|message|>{"a": "x"}', False)):
            matcher = compiler.compile(StructuredOutputParams(grammar=grammar)).result().matcher()
            token_ids = tokenizer.encode(reply, add_special_tokens=False)
            assert (matcher.advance(token_ids) == len(token_ids) and matcher.is_complete) == whole, reply
    finally:
        compiler.shutdown()
