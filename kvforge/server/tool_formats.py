"""How a model writes its tool calls: the text around a call's name and arguments, its grammar and its parsing.

    hermes       <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>
                 (calls separated by a newline; Qwen2.5's and Hermes-style templates, and the generic prompt)
    llama3_json  {"name": "get_weather", "parameters": {"city": "Paris"}}
                 (calls separated by "; "; Llama 3.1's template asks for this)
    mistral      [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]
                 (one list of calls, separated by ", "; Mistral 7B v0.3's and Mixtral's templates)
    mistral_args [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}
                 (each call after its own [TOOL_CALLS]; the templates of Mistral's later tokenizers, which have [ARGS])

Mistral's [TOOL_CALLS] and [ARGS] are special tokens: a grammar asks for them by id (the model writes them as one
token each, never spelt out) and a reply read for such calls keeps special tokens in its text.

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
    alphanumeric call ids the model's template accepts (None: any id)."""

    name: str
    before_name: str
    before_arguments: str
    after_arguments: str
    separator: str
    opening: str = ""
    closing: str = ""
    special_tokens: tuple[str, ...] = ()
    call_id_length: int | None = None
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
        def literal(text: str) -> str:
            parts = re.split(f"({'|'.join(map(re.escape, special_ids))})", text) if special_ids else [text]
            return " ".join(f"<[{special_ids[part]}]>" if part in special_ids else json.dumps(part)
                            for part in parts if part)

        calls = []
        for tool in tools:
            schema = {**(tool.parameters or NO_PARAMETERS), "x-guidance": JSON_OPTIONS}
            before = literal(f"{self.before_name}{tool.name}{self.before_arguments}")
            calls.append(f"{before} %json {json.dumps(schema)} {literal(self.after_arguments)}".rstrip())
        more = " (" + " ".join(filter(None, [literal(self.separator), "call"])) + ")*" if parallel else ""
        sequence = filter(None, ["LEAD?", literal(self.opening), "call" + more, literal(self.closing)])
        rules = ["start: calls" + (" | TEXT" if allow_text else ""), "calls: " + " ".join(sequence),
                 "call: " + " | ".join(calls), f"LEAD: /[{_SPACE_CLASS}]{{1,{_MAX_LEAD}}}/"]
        if allow_text:  # a special token is never text: any text is not a call then
            first = "" if self._lead_is_special(special_ids) else re.escape(self.lead[0])
            rules.append(f"TEXT: /[{_SPACE_CLASS}]*[^{first}{_SPACE_CLASS}](?s:.)*/")
        return "\n".join(rules)

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
        marker = self.lead.split()[0]
        if marker in self.special_tokens:  # it comes whole, as one token: a call once it is there
            return lead.startswith(marker) or marker.startswith(lead)
        return not lead or lead.startswith(self.lead[0]) and len(text) < _MAX_UNDECIDED_CHARS

    def _lead_is_special(self, special_ids: Mapping[str, int]) -> bool:
        return any(self.lead.startswith(token) for token in special_ids)


HERMES = CallFormat("hermes", '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "\n")
LLAMA3_JSON = CallFormat("llama3_json", '{"name": "', '", "parameters": ', "}", "; ")
MISTRAL = CallFormat("mistral", '{"name": "', '", "arguments": ', "}", ", ", opening="[TOOL_CALLS] [", closing="]",
                     special_tokens=("[TOOL_CALLS]",), call_id_length=9)
MISTRAL_ARGS = CallFormat("mistral_args", "[TOOL_CALLS]", "[ARGS]", "", "",
                          special_tokens=("[TOOL_CALLS]", "[ARGS]"), call_id_length=9)
_ID_CHARS = string.ascii_letters + string.digits


def call_format_of(template: str) -> CallFormat:
    """The format a chat template that renders tools asks for: Mistral's when it writes [TOOL_CALLS] (with [ARGS]
    after each name in its later templates), Llama 3's JSON when it speaks of "parameters" and has no <tool_call>
    tags, Hermes' otherwise."""
    if "[TOOL_CALLS]" in template:
        return MISTRAL_ARGS if "[ARGS]" in template else MISTRAL
    return LLAMA3_JSON if '"parameters"' in template and "<tool_call>" not in template else HERMES
