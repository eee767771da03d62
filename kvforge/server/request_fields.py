"""Every field of a request (completions, chat, responses, pooling) is honoured, refused, or reported ignored.

A field that no protocol model declares is a 400 naming it, as OpenAI answers one. The few fields below,
which OpenAI's or vLLM's clients send and which change nothing kvforge returns, are accepted; the response
says which ones it ignored in the IGNORED_FIELDS_HEADER header, and the log says so once per request.
"""

from __future__ import annotations

import logging

from pydantic import BaseModel

from kvforge.server.errors import APIError

logger = logging.getLogger(__name__)

IGNORED_FIELDS_HEADER = "kvforge-ignored-fields"

# name -> why kvforge ignores it
IGNORED_FIELDS: dict[str, str] = {
    "user": "an end-user id for the provider's abuse monitoring; kvforge keeps no per-user records",
    "store": "kvforge stores no completions for later retrieval",
    "metadata": "tags for stored completions, and kvforge stores none",
    "service_tier": "kvforge serves every request in the one tier it has",
    "priority": "the scheduler serves requests first come, first served",
    "request_id": "the server names its requests itself (the response's id)",
    "cache_salt": "one prefix cache serves every request; nothing separates tenants",
}


def check_fields(body: BaseModel) -> dict[str, str]:
    """The response headers for body's ignored fields (none: {}); 400 naming the first unknown field."""
    extra = body.model_extra or {}
    unknown = [name for name in extra if name not in IGNORED_FIELDS]
    if unknown:
        raise APIError(400, f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0],
                       code="unrecognized_argument")
    if not extra:
        return {}
    names = ", ".join(extra)
    logger.warning("a request's fields %s were accepted and ignored", names)
    return {IGNORED_FIELDS_HEADER: names}
