"""Tool calling for chat completions: the tools in the prompt and the grammar of the reply (tool_formats.py reads it).

A tool call is written the way Hermes-style templates write it (tool_formats.HERMES):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

or, when the chat template renders the tools, the way it asks for (Llama 3's JSON, Mistral's [TOOL_CALLS], GPT-OSS's
harmony: see tool_formats.py). With `tool_choice` "required" or a named function the grammar allows nothing else,
and the arguments follow the function's JSON schema; with "auto" it allows a call like that or any text that does
not start as a call does ("<", or "{" for Llama 3's JSON; any text for Mistral's, whose calls start with a special
token). With `parallel_tool_calls` (the default) a reply may hold several calls, one after the other (a newline
between Hermes calls, "; " between Llama 3's); without it, exactly one. A chat template that renders `tools` gets
them as they are (and the assistant's earlier calls as Tokenizer.apply_chat_template passes them: their arguments
as objects); for one that does not (the default model's), GENERIC_TOOL_PROMPT is added to the system message, the
assistant's earlier calls are written back in the format above and `role: "tool"` messages become user messages
wrapped in <tool_response> tags.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvforge.server.errors import APIError
from kvforge.server.protocol import ChatCompletionRequest, FunctionDefinition
from kvforge.server.tool_formats import HERMES, NO_PARAMETERS, CallFormat, call_format_of
from kvforge.structured_output.params import StructuredOutputParams
from kvforge.tokenizer import Tokenizer

GENERIC_TOOL_PROMPT = """You can call functions to help you answer. The functions, with JSON schemas of their \
arguments:
{tools}
To call a function, reply with nothing but (one such block per call):
<tool_call>
{{"name": "<function name>", "arguments": <its arguments as a JSON object>}}
</tool_call>"""


@dataclass(slots=True)
class ToolPlan:
    """How one chat request uses its tools: the messages and template arguments that render them, the
    grammar of the reply (None: unconstrained), and the format replies are read for calls in (None: not read)."""

    messages: list[dict[str, Any]]
    template_kwargs: dict[str, Any]
    structured_output: StructuredOutputParams | None
    calls: CallFormat | None


def plan_tools(body: ChatCompletionRequest, messages: list[dict[str, Any]], tokenizer: Tokenizer) -> ToolPlan:
    """The plan for body's tools and tool_choice under tokenizer's chat template; 400 for a choice that names no
    tool."""
    template = tokenizer.chat_template
    choice = body.tool_choice or ("auto" if body.tools else "none")
    if choice != "none" and not body.tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    renders_tools = template is not None and "tools" in template
    if choice == "none":  # earlier calls and results still go back to the model
        return ToolPlan(messages if renders_tools else [_generic_message(m) for m in messages], {}, None, None)
    tools = [t.function for t in body.tools]
    if not isinstance(choice, str):
        tools = [t for t in tools if t.name == choice.function.name]
        if not tools:
            raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not among "
                                f"the tools {[t.function.name for t in body.tools]}", param="tool_choice")
    if body.response_format is not None and body.response_format.type != "text":
        raise APIError(400, "response_format cannot be combined with tools unless tool_choice is none",
                       param="response_format")
    call_format = call_format_of(template) if renders_tools else HERMES
    grammar = StructuredOutputParams(grammar=call_format.grammar(
        tools, allow_text=choice == "auto", parallel=body.parallel_tool_calls,
        special_ids=special_ids(call_format, tokenizer)))
    if renders_tools:
        return ToolPlan(messages, {"tools": [t.model_dump(exclude_none=True) for t in body.tools]}, grammar,
                        call_format)
    return ToolPlan(_generic_messages(messages, [t.function for t in body.tools]), {}, grammar, call_format)


def special_ids(call_format: CallFormat, tokenizer: Tokenizer) -> dict[str, int]:
    """The ids of those of call_format's special tokens that tokenizer's vocabulary has."""
    ids = {token: tokenizer.backend.token_to_id(token) for token in call_format.special_tokens}
    return {token: token_id for token, token_id in ids.items() if token_id is not None}


def _generic_messages(messages: list[dict[str, Any]], tools: list[FunctionDefinition]) -> list[dict[str, Any]]:
    listing = "\n".join(json.dumps({"name": t.name, "description": t.description or "",
                                    "parameters": t.parameters or NO_PARAMETERS}) for t in tools)
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
    written = [HERMES.write(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    content = HERMES.separator.join(filter(None, [message.get("content"), *written]))
    return {"role": "assistant", "content": content}
