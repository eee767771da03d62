"""ASGI middleware run before any route: the API key check (401), the body size limit (413) and the
body read timeout (408)."""

from __future__ import annotations

import asyncio
import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvforge.server.errors import error_response

# The environment variable `kvforge serve` and `kvforge router` read the API key from (where no --api-key is given).
API_KEY_ENV = "KVFORGE_API_KEY"
# Routes open without the API key, like vLLM: probes and scrapers carry no credentials.
OPEN_PATHS = ("/health", "/ready", "/metrics", "/version")  # answered without the API key


class APIKeyMiddleware:
    """Requires `Authorization: Bearer <key>` on every route but OPEN_PATHS (the scheme
    name in any case, as RFC 7235 has it); a 401 says the scheme in `WWW-Authenticate`."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").strip().partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.expected):
            message = "missing or invalid API key: send 'Authorization: Bearer <key>'"
            headers = {"WWW-Authenticate": 'Bearer realm="kvforge"'}
            await error_response(401, message, headers=headers)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reads the request body up to max_bytes (413 beyond it) within timeout seconds (408 after,
    and the connection closes), then replays it to the app.

    After the replayed body, `receive` is the server's again, so the app still sees the client's
    `http.disconnect`."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = error_response(413, f"the request body is larger than {self.max_bytes} bytes")
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await too_large(scope, receive, send)
            return
        try:
            body = await asyncio.wait_for(self._read(receive), self.timeout)
        except asyncio.TimeoutError:
            message = f"the request body did not arrive within {self.timeout:g} s"
            await error_response(408, message, headers={"Connection": "close"})(scope, receive, send)
            return
        if body is None:  # the client went away
            return
        if len(body) > self.max_bytes:
            await too_large(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive) -> bytes | None:
        """The whole body, or its first part beyond max_bytes; None if the client disconnects."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes or not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed
