"""The served OpenAPI document, made to say what the server answers.

FastAPI documents a 422 for every route with a body; this server answers validation errors with a
400 in the OpenAI error shape (what OpenAI clients expect), and the middleware adds 401, 408 and
413 that no route declares. The completions routes also stream (`text/event-stream`).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from kvforge.server.metrics import CONTENT_TYPE
from kvforge.server.middleware import OPEN_PATHS
from kvforge.server.protocol import ErrorResponse

_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
_STREAMING_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
_STORED_RESPONSE_PATHS = ("/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel")

# status -> when the server answers it
_BODY_ERRORS = {
    "400": "Invalid request: a field's value, the JSON, or a request that can never be admitted",
    "404": "No such model (or, for /v1/responses, no such previous_response_id)",
    "408": "The request body did not arrive in time",
    "413": "The request body is too large",
    "503": "Overloaded (the admission queue is full) or shutting down; see Retry-After",
}


def _error(description: str, retry_after: bool = False) -> dict[str, Any]:
    response: dict[str, Any] = {"description": description, "content": {"application/json": {"schema": _ERROR_REF}}}
    if retry_after:
        response["headers"] = {"Retry-After": {"description": "Seconds to wait before retrying",
                                               "schema": {"type": "integer"}}}
    return response


def _fix_operation(path: str, method: str, operation: dict[str, Any], authenticated: bool) -> None:
    responses: dict[str, Any] = operation.setdefault("responses", {})
    responses.pop("422", None)
    if method == "post":
        for status, description in _BODY_ERRORS.items():
            responses[status] = _error(description, retry_after=status == "503")
    if path in _STREAMING_PATHS:
        responses["200"].setdefault("content", {})["text/event-stream"] = {"schema": {
            "type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
            "required": ["data"],
            "description": "Server-sent events: one JSON chunk per `data:` line, then `data: [DONE]` (or an error "
                           "event)"}}
    if path in ("/health", "/ready"):
        responses["200"]["content"] = {"application/json": {"schema": {
            "type": "object", "properties": {"status": {"type": "string"}}, "required": ["status"]}}}
        responses["503"] = _error("The engine is not running" if path == "/health" else
                                  "The engine is not running, or still compiling its decode steps (--compile-at-start)")
    if path == "/v1/models/{model_id}":
        responses["404"] = _error(_BODY_ERRORS["404"])
    if path in _STORED_RESPONSE_PATHS:
        responses["404"] = _error("No such stored response")
    if path == "/version":
        responses["200"]["content"] = {"application/json": {"schema": {
            "type": "object", "properties": {"version": {"type": "string"}}, "required": ["version"]}}}
    if path == "/metrics":
        responses["200"]["content"] = {CONTENT_TYPE.split(";")[0]: {"schema": {"type": "string"}}}
    if authenticated and path not in OPEN_PATHS:
        responses["401"] = _error("Missing or invalid API key")
        operation["security"] = [{"bearer": []}]


def build_openapi(app: FastAPI, authenticated: bool) -> dict[str, Any]:
    document = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas: dict[str, Any] = document.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(error_schema.pop("$defs", {}))
    schemas["ErrorResponse"] = error_schema
    if authenticated:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in document.get("paths", {}).items():
        for method, operation in operations.items():
            _fix_operation(path, method, operation, authenticated)
    return document


def install_openapi(app: FastAPI, authenticated: bool) -> None:
    """Serve the fixed document at /openapi.json (built once, on the first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app, authenticated)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
