"""Tool calling for chat completions: the tools in the prompt, the grammar of a call, and its parsing.

A tool call is always written the same way, the format Hermes-style templates use:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

With `tool_choice` "required" or a named function the grammar allows nothing else, and the arguments
follow the function's JSON schema; with "auto" it allows a call like that or any text that does not
start with "<". One call per reply. A chat template that renders `tools` gets them as they are; for one
that does not (the default model's), GENERIC_TOOL_PROMPT is added to the system message, the
assistant's earlier calls are written back in the format above and `role: "tool"` messages become
user messages wrapped in <tool_response> tags.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from kvforge.server.errors import APIError
from kvforge.server.protocol import ChatCompletionRequest, FunctionDefinition
from kvforge.structured_output.compiler import JSON_OPTIONS
from kvforge.structured_output.params import StructuredOutputParams

CALL_START, CALL_END = "<tool_call>\n", "\n</tool_call>"
_CALL_PREFIX = re.compile(r'<tool_call>\n\{"name": "([A-Za-z0-9_-]+)", "arguments": ', re.DOTALL)
_ARGUMENTS_END = "}" + CALL_END  # what follows the arguments object
_NO_PARAMETERS = {"type": "object", "properties": {}}

GENERIC_TOOL_PROMPT = """You can call functions to help you answer. The functions, with JSON schemas of their \
arguments:
{tools}
To call a function, reply with nothing but:
<tool_call>
{{"name": "<function name>", "arguments": <its arguments as a JSON object>}}
</tool_call>"""


@dataclass(slots=True)
class ToolPlan:
    """How one chat request uses its tools: the messages and template arguments that render them, the
    grammar of the reply (None: unconstrained), and whether replies are read for a tool call."""

    messages: list[dict[str, Any]]
    template_kwargs: dict[str, Any]
    structured_output: StructuredOutputParams | None
    reads_calls: bool


def plan_tools(body: ChatCompletionRequest, messages: list[dict[str, Any]], template: str | None) -> ToolPlan:
    """The plan for body's tools and tool_choice; 400 for a choice that names no tool."""
    choice = body.tool_choice or ("auto" if body.tools else "none")
    if choice != "none" and not body.tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    renders_tools = template is not None and "tools" in template
    if choice == "none":  # earlier calls and results still go back to the model
        return ToolPlan(messages if renders_tools else [_generic_message(m) for m in messages], {}, None, False)
    tools = [t.function for t in body.tools]
    if not isinstance(choice, str):
        tools = [t for t in tools if t.name == choice.function.name]
        if not tools:
            raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not among "
                                f"the tools {[t.function.name for t in body.tools]}", param="tool_choice")
    if body.response_format is not None and body.response_format.type != "text":
        raise APIError(400, "response_format cannot be combined with tools unless tool_choice is none",
                       param="response_format")
    grammar = StructuredOutputParams(grammar=call_grammar(tools, allow_text=choice == "auto"))
    if renders_tools:
        return ToolPlan(messages, {"tools": [t.model_dump(exclude_none=True) for t in body.tools]}, grammar, True)
    return ToolPlan(_generic_messages(messages, [t.function for t in body.tools]), {}, grammar, True)


def call_grammar(tools: list[FunctionDefinition], allow_text: bool) -> str:
    """A Lark grammar of one call of one of tools (or, if allow_text, text not starting with "<")."""
    calls = []
    for tool in tools:
        schema = {**(tool.parameters or _NO_PARAMETERS), "x-guidance": JSON_OPTIONS}
        prefix = f'{CALL_START}{{"name": "{tool.name}", "arguments": '
        calls.append(f"{json.dumps(prefix)} %json {json.dumps(schema)} {json.dumps(_ARGUMENTS_END)}")
    rules = ["start: call" + (" | TEXT" if allow_text else ""), "call: " + " | ".join(calls)]
    if allow_text:
        rules.append("TEXT: /[^<](?s:.)*/")
    return "\n".join(rules)


def _generic_messages(messages: list[dict[str, Any]], tools: list[FunctionDefinition]) -> list[dict[str, Any]]:
    listing = "\n".join(json.dumps({"name": t.name, "description": t.description or "",
                                    "parameters": t.parameters or _NO_PARAMETERS}) for t in tools)
    prompt = GENERIC_TOOL_PROMPT.format(tools=listing)
    rewritten = [_generic_message(m) for m in messages]
    if rewritten and rewritten[0]["role"] == "system":
        rewritten[0] = {**rewritten[0], "content": f"{rewritten[0].get('content') or ''}\n\n{prompt}".lstrip()}
    else:
        rewritten.insert(0, {"role": "system", "content": prompt})
    return rewritten


def _generic_message(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant's tool calls written out, a tool result as a user message; other messages as they are."""
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
    calls = message.get("tool_calls")
    if message["role"] != "assistant" or not calls:
        return message
    written = [f'{CALL_START}{{"name": "{c["function"]["name"]}", "arguments": {c["function"]["arguments"]}}}'
               f"{CALL_END}" for c in calls]
    content = "\n".join(filter(None, [message.get("content"), *written]))
    return {"role": "assistant", "content": content}


def parse_call(text: str, finished: bool) -> tuple[str, str] | None:
    """(function name, its arguments so far) when text is a tool call, else None.

    While the call runs, the arguments end before the last len('}\\n</tool_call>') characters, which may
    be the call's end, so what a stream sends is always a prefix of the final arguments."""
    match = _CALL_PREFIX.match(text)
    if match is None:
        return None
    arguments = text[match.end():]
    if arguments.endswith(_ARGUMENTS_END):
        arguments = arguments[: -len(_ARGUMENTS_END)]
    elif not finished:
        arguments = arguments[: max(0, len(arguments) - len(_ARGUMENTS_END))]
    return match.group(1), arguments


def may_become_call(text: str) -> bool:
    """Whether text is still short of deciding between a tool call and plain text."""
    return _CALL_PREFIX.match(text) is None and (text.startswith("<") and len(text) < 96 or not text)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
