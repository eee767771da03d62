"""The text of a request the router routes by: what the replica's prefix cache will see first.

A completion's prompt, or a chat's messages in order (role and text of each), or an embedding's input. Token-id
prompts become their ids written out, so equal id prefixes still share a text prefix. Only the text's start
matters (the router compares prefixes), so a batch of prompts is routed by its first one.
"""

from __future__ import annotations

from typing import Any

# The POST routes the router forwards, and the body field each is routed by.
ROUTED_FIELDS = {"/v1/completions": "prompt", "/v1/chat/completions": "messages", "/v1/embeddings": "input"}


def routing_text(path: str, payload: Any) -> str:
    """The text to route `payload` (a JSON body of POST `path`) by; ValueError for a body that is no object."""
    if not isinstance(payload, dict):
        raise ValueError(f"the request body must be a JSON object, got {type(payload).__name__}")
    value = payload.get(ROUTED_FIELDS[path])
    if path == "/v1/chat/completions":
        return _messages_text(value)
    return _prompt_text(value)


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):
            return " ".join(str(token) for token in prompt)
        return _prompt_text(first)
    return ""


def _messages_text(messages: Any) -> str:
    if not isinstance(messages, list):
        return ""
    parts = []
    for message in messages:
        if isinstance(message, dict):
            parts.append(f"<{message.get('role')}>{_content_text(message.get('content'))}")
    return "\n".join(parts)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # parts: [{"type": "text", "text": ...}, {"type": "image_url", ...}]
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""
