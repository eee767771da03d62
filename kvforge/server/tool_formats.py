"""How a model writes its tool calls: the text around a call's name and arguments, its grammar and its parsing.

    hermes       <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>
                 (calls separated by a newline; Qwen2.5's and Hermes-style templates, and the generic prompt)
    llama3_json  {"name": "get_weather", "parameters": {"city": "Paris"}}
                 (calls separated by "; "; Llama 3.1's template asks for this)

Whitespace may come before the first call (a model often writes a blank line after its reasoning). The
arguments object ends where the JSON object ends (json.JSONDecoder.raw_decode finds it), so a stream
sends each call's arguments as they grow and they never take anything back.
"""

from __future__ import annotations

import json
import re
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
    joined by separator."""

    name: str
    before_name: str
    before_arguments: str
    after_arguments: str
    separator: str
    _prefix: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        prefix = re.escape(self.before_name) + r"([A-Za-z0-9_.-]+)" + re.escape(self.before_arguments)
        object.__setattr__(self, "_prefix", re.compile(prefix))

    def write(self, name: str, arguments: str) -> str:
        """One call as the model writes it (arguments: a JSON object's text)."""
        return f"{self.before_name}{name}{self.before_arguments}{arguments}{self.after_arguments}"

    def grammar(self, tools: list[FunctionDefinition], allow_text: bool, parallel: bool) -> str:
        """A Lark grammar of a call of one of tools, or if parallel of one or more calls (or, if allow_text,
        of text that does not start as a call does)."""
        calls = []
        for tool in tools:
            schema = {**(tool.parameters or NO_PARAMETERS), "x-guidance": JSON_OPTIONS}
            prefix = f"{self.before_name}{tool.name}{self.before_arguments}"
            calls.append(f"{json.dumps(prefix)} %json {json.dumps(schema)} {json.dumps(self.after_arguments)}")
        rules = ["start: calls" + (" | TEXT" if allow_text else ""),
                 "calls: LEAD? call" + (f" ({json.dumps(self.separator)} call)*" if parallel else ""),
                 "call: " + " | ".join(calls), f"LEAD: /[{_SPACE_CLASS}]{{1,{_MAX_LEAD}}}/"]
        if allow_text:
            first = re.escape(self.before_name[0])
            rules.append(f"TEXT: /[{_SPACE_CLASS}]*[^{first}{_SPACE_CLASS}](?s:.)*/")
        return "\n".join(rules)

    def parse(self, text: str) -> list[tuple[str, str]] | None:
        """[(function name, its arguments so far)] when text is calls (the last one may be unfinished), else None."""
        calls: list[tuple[str, str]] = []
        position = len(text) - len(text.lstrip(_SPACE_CHARS))
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
        if self._prefix.match(lead) is not None:
            return False
        return not lead or lead.startswith(self.before_name[0]) and len(text) < _MAX_UNDECIDED_CHARS


HERMES = CallFormat("hermes", '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "\n")
LLAMA3_JSON = CallFormat("llama3_json", '{"name": "', '", "parameters": ', "}", "; ")


def call_format_of(template: str) -> CallFormat:
    """The format a chat template that renders tools asks for: Llama 3's JSON when it speaks of "parameters"
    and has no <tool_call> tags, Hermes' otherwise."""
    return LLAMA3_JSON if '"parameters"' in template and "<tool_call>" not in template else HERMES
