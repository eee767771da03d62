"""Forwarding one request to a replica: retried elsewhere until a byte has reached the client, streamed as it
arrives after that, and ended with an error event (never left hanging) when the replica dies mid-stream.

```
 choose ─► send ─► status + first event ─► client ─► event ─► ... ─► [DONE]
   ▲         │ connection error / replica down          │ connection error / replica down
   └─ retry ─┘ (nothing sent to the client yet)         └─► `data: {"error": ...}` and the stream ends
```
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

import httpx
from starlette.responses import Response, StreamingResponse

from kvforge.router.policy import Choice
from kvforge.router.replica import Replica
from kvforge.server.errors import error_body, error_response

T = TypeVar("T")
# The request headers a replica needs; the rest (host, content-length, ...) are its own connection's.
_FORWARDED_HEADERS = ("authorization", "content-type", "accept")


class ReplicaFailed(Exception):
    """The replica went away (a connection error, or the health checks took it out) before it answered."""


async def until_down(replica: Replica, awaitable: Awaitable[T]) -> T:
    """The awaitable's result, unless the replica is taken out first (then ReplicaFailed)."""
    work = asyncio.ensure_future(awaitable)
    down = asyncio.ensure_future(replica.down.wait())
    try:
        await asyncio.wait((work, down), return_when=asyncio.FIRST_COMPLETED)
    finally:
        down.cancel()
        if not work.done():
            work.cancel()
    if not work.done() or work.cancelled():
        raise ReplicaFailed(f"replica {replica.url} was taken out")
    try:
        return work.result()
    except httpx.TransportError as error:
        raise ReplicaFailed(f"replica {replica.url}: {type(error).__name__}: {error}") from error


async def _events(replica: Replica, upstream: httpx.Response) -> AsyncIterator[bytes]:
    """The replica's server-sent events, each whole (`data: ...\\n\\n`), as they arrive."""
    chunks = upstream.aiter_raw()
    pending = b""
    while True:
        try:
            chunk = await until_down(replica, chunks.__anext__())
        except StopAsyncIteration:
            break
        pending += chunk
        *events, pending = pending.split(b"\n\n")
        for event in events:
            yield event + b"\n\n"
    if pending.strip():
        raise ReplicaFailed(f"replica {replica.url} ended the stream inside an event")


class Forwarder:
    """Sends requests to replicas chosen by `choose` (which sees the healthy replicas not yet tried)."""

    def __init__(self, http: httpx.AsyncClient, replicas: Sequence[Replica],
                 choose: Callable[[list[Replica], str], Choice]) -> None:
        self.http = http
        self.replicas = replicas
        self.choose = choose
        self.num_retries = 0  # requests sent again after a replica failed them
        self.num_unserved = 0  # requests answered 503: no replica left to try

    async def forward(self, path: str, body: bytes, headers: dict[str, str], text: str, stream: bool) -> Response:
        """The replica's answer to POST `path`, from the first replica that gives one."""
        headers = {k: v for k, v in headers.items() if k.lower() in _FORWARDED_HEADERS}
        tried: list[Replica] = []
        while True:
            candidates = [r for r in self.replicas if r.healthy and r not in tried]
            if not candidates:
                self.num_unserved += 1
                reason = "every replica failed this request" if tried else "no replica is healthy"
                return error_response(503, reason, headers={"Retry-After": "1"})
            choice = self.choose(candidates, text)
            replica = choice.replica
            replica.num_requests += 1
            replica.num_prefix_hits += choice.prefix_hit
            replica.num_in_flight += 1
            try:
                return await self._send(replica, path, body, headers, stream)
            except ReplicaFailed as error:
                replica.num_in_flight -= 1
                replica.num_failures += 1
                replica.mark_down(str(error))
                tried.append(replica)
                self.num_retries += 1

    async def _send(self, replica: Replica, path: str, body: bytes, headers: dict[str, str],
                    stream: bool) -> Response:
        """Raises ReplicaFailed while nothing has been sent to the client; the caller keeps num_in_flight then."""
        request = self.http.build_request("POST", replica.url + path, content=body, headers=headers)
        upstream = await until_down(replica, self.http.send(request, stream=True))
        try:
            if not stream or upstream.status_code != 200:
                content = await until_down(replica, upstream.aread())
                replica.num_in_flight -= 1
                return Response(content, upstream.status_code, media_type=upstream.headers.get("content-type"),
                                headers=_passed_headers(upstream))
            events = _events(replica, upstream)
            first = await until_down(replica, _first(events))
        except BaseException:
            await upstream.aclose()
            raise
        return StreamingResponse(self._relay(replica, upstream, first, events), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", **_passed_headers(upstream)})

    async def _relay(self, replica: Replica, upstream: httpx.Response, first: bytes,
                     events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            yield first
            try:
                async for event in events:
                    yield event
            except ReplicaFailed as error:
                replica.num_failures += 1
                replica.mark_down(str(error))
                yield f"data: {json.dumps(error_body(502, f'the stream broke off: {error}'))}\n\n".encode()
        finally:
            replica.num_in_flight -= 1
            await upstream.aclose()


async def _first(events: AsyncIterator[bytes]) -> bytes:
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        raise ReplicaFailed("the replica ended the stream before its first event") from None


def _passed_headers(upstream: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() in ("retry-after", "x-request-id")}
