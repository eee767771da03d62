"""How a model writes its tool calls: the text around a call's name and arguments, its grammar and its parsing.

    hermes       <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>
                 (calls separated by a newline; Qwen2.5's and Hermes-style templates, and the generic prompt)
    llama3_json  {"name": "get_weather", "parameters": {"city": "Paris"}}
                 (calls separated by "; "; Llama 3.1's template asks for this)
    mistral      [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]
                 (one list of calls, separated by ", "; Mistral 7B v0.3's and Mixtral's templates)
    mistral_args [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}
                 (each call after its own [TOOL_CALLS]; the templates of Mistral's later tokenizers, which have [ARGS])
    harmony      <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}
                 (GPT-OSS: a message to a function, as reasoning/harmony.py hands it over; its grammar lets an
                 analysis message come first, and under "auto" the alternative is a final message)

Mistral's [TOOL_CALLS] and [ARGS] (and harmony's markers) are special tokens: a grammar asks for them by id (the
model writes them as one token each, never spelt out) and a reply read for such calls keeps special tokens in its
text.

Whitespace may come before the first call (a model often writes a blank line after its reasoning). The
arguments object ends where the JSON object ends (json.JSONDecoder.raw_decode finds it), so a stream
sends each call's arguments as they grow and they never take anything back.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvforge.reasoning.harmony import CALL_ARGUMENTS, CALL_HEADER, SPECIAL_TOKENS
from kvforge.server.protocol import FunctionDefinition
from kvforge.structured_output.compiler import JSON_OPTIONS

NO_PARAMETERS = {"type": "object", "properties": {}}  # the schema of a function declared without parameters
_DECODER = json.JSONDecoder()
_SPACE_CHARS = " \t\n"  # what may come before the first call
_SPACE_CLASS = _SPACE_CHARS.encode("unicode_escape").decode()  # the same in a grammar's regular expression
_MAX_LEAD = 4  # characters of it, in a grammar (a model free to write whitespace may never stop)
# Text this long that starts like a call but is not one yet is text: no name is that long.
_MAX_UNDECIDED_CHARS = 96


@dataclass(frozen=True, slots=True)
class CallFormat:
    """A call is before_name + name + before_arguments + a JSON object + after_arguments; calls are
    joined by separator, and all of them written between opening and closing. special_tokens: the texts in
    these that are single special tokens of the model's vocabulary; call_id_length: the length of the
    alphanumeric call ids the model's template accepts (None: any id). preamble: (opening, closing) of a message of
    any text the grammar lets come before the calls (None: none); text_opening: what a reply that is text, not
    calls, starts with ("": any text that does not start as a call does)."""

    name: str
    before_name: str
    before_arguments: str
    after_arguments: str
    separator: str
    opening: str = ""
    closing: str = ""
    special_tokens: tuple[str, ...] = ()
    call_id_length: int | None = None
    preamble: tuple[str, str] | None = None
    text_opening: str = ""
    _prefix: re.Pattern = field(init=False, repr=False, compare=False)
    _opening: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        prefix = re.escape(self.before_name) + r"([A-Za-z0-9_.-]+)" + re.escape(self.before_arguments)
        object.__setattr__(self, "_prefix", re.compile(prefix))
        # NOTE: a space in the opening may be any run of whitespace, or none, when a reply is read
        object.__setattr__(self, "_opening", re.compile(re.escape(self.opening).replace(r"\ ", r"\s*")))

    @property
    def lead(self) -> str:
        """What a reply of calls starts with."""
        return self.opening or self.before_name

    def write(self, name: str, arguments: str) -> str:
        """One call as the model writes it (arguments: a JSON object's text)."""
        return f"{self.before_name}{name}{self.before_arguments}{arguments}{self.after_arguments}"

    def write_all(self, calls: list[tuple[str, str]]) -> str:
        """A reply of calls [(name, arguments)] as the model writes it."""
        return self.opening + self.separator.join(self.write(name, arguments) for name, arguments in calls) + \
            self.closing

    def new_call_id(self) -> str:
        """An id for a call read from a reply, of the shape the model's template takes back."""
        if self.call_id_length is None:
            return f"call_{uuid.uuid4().hex[:24]}"
        return "".join(secrets.choice(_ID_CHARS) for _ in range(self.call_id_length))

    def grammar(self, tools: list[FunctionDefinition], allow_text: bool, parallel: bool,
                special_ids: Mapping[str, int]) -> str:
        """A Lark grammar of a call of one of tools, or if parallel of one or more calls (or, if allow_text,
        of text that does not start as a call does). special_ids: the ids of those of special_tokens that the
        vocabulary has (the others are asked for as text)."""
        literal = _Literals(special_ids)
        calls = []
        for tool in tools:
            schema = {**(tool.parameters or NO_PARAMETERS), "x-guidance": JSON_OPTIONS}
            before = literal(f"{self.before_name}{tool.name}{self.before_arguments}")
            calls.append(f"{before} %json {json.dumps(schema)} {literal(self.after_arguments)}".rstrip())
        more = " (" + " ".join(filter(None, [literal(self.separator), "call"])) + ")*" if parallel else ""
        sequence = filter(None, ["LEAD?", literal(self.opening), "call" + more, literal(self.closing)])
        rules = [self._start("calls" + (" | text" if allow_text else "")), "calls: " + " ".join(sequence),
                 "call: " + " | ".join(calls), f"LEAD: /[{_SPACE_CLASS}]{{1,{_MAX_LEAD}}}/",
                 *self._preamble_rules(literal)]
        if allow_text and self.text_opening:
            rules += [f"text: {literal(self.text_opening)} ANY", "ANY: /(?s:.)*/"]
        elif allow_text:  # a special token is never text: any text is not a call then
            first = "" if any(self.lead.startswith(token) for token in special_ids) else re.escape(self.lead[0])
            rules += ["text: TEXT", f"TEXT: /[{_SPACE_CLASS}]*[^{first}{_SPACE_CLASS}](?s:.)*/"]
        return "\n".join(dict.fromkeys(rules))

    def text_grammar(self, schema: Any, special_ids: Mapping[str, int]) -> str:
        """A Lark grammar of a reply whose text, after the preamble and text_opening, is JSON of schema (a model
        whose text has an opening of its own: harmony's final message)."""
        literal = _Literals(special_ids)
        schema = {**schema, "x-guidance": JSON_OPTIONS} if isinstance(schema, dict) else schema
        return "\n".join(dict.fromkeys([self._start("text"), f"text: {literal(self.text_opening)} %json "
                                         f"{json.dumps(schema)}", *self._preamble_rules(literal)]))

    def _start(self, body: str) -> str:
        return f"start: {'preamble? ' if self.preamble else ''}({body})"

    def _preamble_rules(self, literal: _Literals) -> list[str]:
        if self.preamble is None:
            return []
        opening, closing = self.preamble
        return [f"preamble: {literal(opening)} ANY {literal(closing)}", "ANY: /(?s:.)*/"]

    def parse(self, text: str) -> list[tuple[str, str]] | None:
        """[(function name, its arguments so far)] when text is calls (the last one may be unfinished), else None."""
        calls: list[tuple[str, str]] = []
        position = len(text) - len(text.lstrip(_SPACE_CHARS))
        if (opening := self._opening.match(text, position)) is None:
            return None
        position = opening.end()
        while (match := self._prefix.match(text, position)) is not None:
            try:
                _, end = _DECODER.raw_decode(text, match.end())
            except json.JSONDecodeError:  # still being written
                calls.append((match.group(1), text[match.end():]))
                break
            calls.append((match.group(1), text[match.end():end]))
            if not text.startswith(self.after_arguments, end):
                break
            position = end + len(self.after_arguments)
            position += len(self.separator) if text.startswith(self.separator, position) else 0
        return calls or None

    def may_become_call(self, text: str) -> bool:
        """Whether text is still short of deciding between a call and plain text."""
        lead = text.lstrip(_SPACE_CHARS)
        if self.parse(lead) is not None:
            return False
        if any(self.lead.startswith(token) for token in self.special_tokens):  # it comes whole, as one token
            return lead.startswith(self.lead) or self.lead.startswith(lead)
        return not lead or lead.startswith(self.lead[0]) and len(text) < _MAX_UNDECIDED_CHARS


class _Literals:
    """A text as a Lark sequence: its special tokens asked for by id (those of special_ids), the rest as strings."""

    def __init__(self, special_ids: Mapping[str, int]) -> None:
        self.special_ids = special_ids
        self._split = re.compile(f"({'|'.join(map(re.escape, special_ids))})") if special_ids else None

    def __call__(self, text: str) -> str:
        parts = self._split.split(text) if self._split is not None else [text]
        return " ".join(f"<[{self.special_ids[part]}]>" if part in self.special_ids else json.dumps(part)
                        for part in parts if part)


HERMES = CallFormat("hermes", '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "\n")
LLAMA3_JSON = CallFormat("llama3_json", '{"name": "', '", "parameters": ', "}", "; ")
MISTRAL = CallFormat("mistral", '{"name": "', '", "arguments": ', "}", ", ", opening="[TOOL_CALLS] [", closing="]",
                     special_tokens=("[TOOL_CALLS]",), call_id_length=9)
MISTRAL_ARGS = CallFormat("mistral_args", "[TOOL_CALLS]", "[ARGS]", "", "",
                          special_tokens=("[TOOL_CALLS]", "[ARGS]"), call_id_length=9)
HARMONY = CallFormat("harmony", CALL_HEADER, CALL_ARGUMENTS, "", "", special_tokens=SPECIAL_TOKENS,
                     preamble=("<|channel|>analysis<|message|>", "<|end|><|start|>assistant"),
                     text_opening="<|channel|>final<|message|>")
_ID_CHARS = string.ascii_letters + string.digits


def call_format_of(template: str) -> CallFormat:
    """The format a chat template that renders tools asks for: harmony's when it writes channels, Mistral's when it
    writes [TOOL_CALLS] (with [ARGS] after each name in its later templates), Llama 3's JSON when it speaks of
    "parameters" and has no <tool_call> tags, Hermes' otherwise."""
    if "<|channel|>" in template:
        return HARMONY
    if "[TOOL_CALLS]" in template:
        return MISTRAL_ARGS if "[ARGS]" in template else MISTRAL
    return LLAMA3_JSON if '"parameters"' in template and "<tool_call>" not in template else HERMES
