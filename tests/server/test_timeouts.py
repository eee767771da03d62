"""Sockets that end: a body that stops arriving gets 408 and a closed connection, an idle keep-alive
connection is closed, and a shutdown ends the requests still running at its deadline (a stream with
an error event, a plain request with 503) instead of waiting for them."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvforge.server.app import ServerConfig
from tests.server.harness import ServerThread, start_tiny_server

TIMEOUTS = {"body_read_timeout": 1.0, "keep_alive_timeout": 1.0, "shutdown_timeout": 1.0}


@pytest.fixture(scope="module")
def quick_server(tiny_model_dir: Path) -> Iterator[ServerThread]:
    server = start_tiny_server(tiny_model_dir, api_key=None, server_options=TIMEOUTS)
    yield server
    server.stop()


def _read_until_closed(sock: socket.socket, limit: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and the seconds that took."""
    start = time.monotonic()
    sock.settimeout(limit)
    received = b""
    while chunk := sock.recv(65536):  # socket.timeout (a test failure) if the server never closes
        received += chunk
    return received, time.monotonic() - start


def test_a_body_that_stops_arriving_is_408_and_closed(quick_server: ServerThread) -> None:
    with socket.create_connection(("127.0.0.1", quick_server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n" + b'{"prompt": "Hi", ')
        received, _ = _read_until_closed(sock, limit=10)
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), head
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_idle_keep_alive_connections_are_closed(quick_server: ServerThread) -> None:
    with socket.create_connection(("127.0.0.1", quick_server.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        received, _ = _read_until_closed(sock, limit=10)
    assert received.startswith(b"HTTP/1.1 200")


def test_shutdown_ends_requests_at_its_deadline(tiny_model_dir: Path) -> None:
    server = start_tiny_server(tiny_model_dir, api_key=None, server_options=TIMEOUTS)
    engine = server.engine.engine
    step = engine.step

    def slow_step():  # the engine thread calls this: 400 tokens now take 20 s
        time.sleep(0.05)
        return step()

    engine.step = slow_step
    body = {"prompt": "Hi", "max_tokens": 400, "ignore_eos": True, "temperature": 0}

    async def run() -> tuple[list[str], httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            plain = asyncio.ensure_future(http.post("/v1/completions", json=body))
            events = []
            async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        events.append(line[5:].strip())
                        if len(events) == 2:
                            server.server.should_exit = True  # what SIGTERM does
            return events, await plain

    try:
        events, plain = asyncio.run(asyncio.wait_for(run(), timeout=60))
        server.thread.join(timeout=30)
        assert not server.thread.is_alive(), "the server did not stop"
    finally:
        server.stop()
    assert "[DONE]" not in events
    assert "shut down" in json.loads(events[-1])["error"]["message"]
    assert all("choices" in json.loads(e) for e in events[:-1]) and len(events) < 100
    assert plain.status_code == 503 and "shut down" in plain.json()["error"]["message"]
    assert plain.headers["Retry-After"] == "1"


@pytest.mark.parametrize("name", ["body_read_timeout", "keep_alive_timeout", "shutdown_timeout"])
def test_timeouts_must_be_positive(name: str) -> None:
    with pytest.raises(ValueError, match=f"{name} must be > 0 seconds, got 0"):
        ServerConfig(("tiny",), **{name: 0})
