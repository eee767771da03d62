"""Errors in the OpenAI shape, {"error": {"message", "type", "param", "code"}}, for every failure."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvforge.engine.async_engine import EngineDeadError, EngineOverloadedError
from kvforge.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

# Seconds a client refused for overload (or a shutdown) should wait before it retries.
RETRY_AFTER_SECONDS = 1

# status -> (OpenAI error type, code)
_KINDS = {
    400: ("invalid_request_error", None),
    401: ("authentication_error", "invalid_api_key"),
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "request_timeout"),
    413: ("invalid_request_error", "request_too_large"),
    500: ("internal_server_error", None),
    503: ("overloaded_error", "service_unavailable"),
}


class APIError(Exception):
    """An error to answer with: HTTP status, message, the request field at fault, extra headers."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    error_type, default_code = _KINDS.get(status, ("invalid_request_error", None))
    info = ErrorInfo(message=message, type=error_type, param=param, code=code or default_code)
    return ErrorResponse(error=info).model_dump()


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def as_api_error(error: BaseException) -> APIError:
    """The status and message for an error raised while serving a request."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, ValueError):
        return APIError(400, str(error))
    if isinstance(error, EngineOverloadedError):
        return APIError(503, str(error), headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(error, EngineDeadError):
        return APIError(500, f"{error}; restart the server")
    logger.error("unexpected error while serving a request", exc_info=error)
    return APIError(500, f"internal error: {type(error).__name__}: {error}")


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    details = error.errors()
    if not details:
        return "invalid request body", None
    # NOTE: a union field reports one error per member; a value check (a lone surrogate in a string,
    # say) says more than "not an int" from the members the value was never meant to be.
    first = next((d for d in details if d.get("type") == "value_error"), details[0])
    if first.get("type") == "json_invalid":  # its loc is a byte offset, not a field
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'invalid JSON')}", None
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = loc[0] if loc else None  # the top-level field; deeper parts name union members too
    message = first.get("msg", "invalid value")
    if param:
        message = f"{param}: {message}"
    if len(details) > 1:
        message += f" (and {len(details) - 1} more problem(s))"
    return message, param


def install_error_handlers(app: FastAPI) -> None:
    """Answer validation errors with 400 (not FastAPI's 422) and every error in the OpenAI shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return error_response(error.status, error.message, error.param, error.code, error.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(error)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_response(error.status_code, str(error.detail), headers=error.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, error: Exception) -> JSONResponse:
        api_error = as_api_error(error)
        return error_response(api_error.status, api_error.message, api_error.param, api_error.code,
                              api_error.headers)
