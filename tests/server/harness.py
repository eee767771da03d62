"""Test helpers: the real app served by uvicorn in a thread, the tiny model, and /metrics readers."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx
import openai

from kvforge.engine.async_engine import AsyncEngine
from kvforge.engine.engines import create_engine
from kvforge.engine_args import build_engine_config
from kvforge.server.app import ServerConfig, build_app
from kvforge.server.lifecycle import uvicorn_server

API_KEY = "test-key"
MODEL_NAME = "tiny"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerThread:
    """The app of an AsyncEngine served by uvicorn in a daemon thread, until stop()."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.app = build_app(engine, config)
        self.server = uvicorn_server(self.app, "127.0.0.1", self.port, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.http = httpx.Client(base_url=self.base_url, timeout=60)  # one connection pool: fast
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    def openai_client(self, timeout: float = 60) -> openai.OpenAI:
        """The official client on this server's /v1, with the test key and no retries."""
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=timeout)

    def stop(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_tiny_server(model_dir: Path, max_queue: int = 1024, api_key: str | None = API_KEY,
                      server_options: dict | None = None, **engine_kwargs: object) -> ServerThread:
    """The tiny model (or a pooling model) served on a free port; server_options go to ServerConfig (timeouts, ...)."""
    engine_kwargs.setdefault("kv_cache_memory", "64MiB")
    # NOTE: eager unless a test asks: the server's tests are about what goes over HTTP, and with a cold Inductor
    # cache each of their servers compiled a bucket or two mid-test (compiled steps have tests/executor's tests)
    engine_kwargs.setdefault("enforce_eager", True)
    engine = create_engine(build_engine_config(model=str(model_dir), **engine_kwargs))
    config = ServerConfig((MODEL_NAME,), api_key=api_key, **(server_options or {}))
    return ServerThread(AsyncEngine(engine, max_queue=max_queue), config)


def metric(http: httpx.Client, name: str) -> float:
    """One sample of /metrics, by its exposed name (e.g. 'kvforge:kv_cache_free_blocks')."""
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} is not in /metrics")


def wait_idle(http: httpx.Client, timeout: float = 30.0) -> None:
    """Wait until no sequence runs or waits, then check every KV block is free again."""
    deadline = time.monotonic() + timeout
    while metric(http, "kvforge:num_requests_running") + metric(http, "kvforge:num_requests_waiting"):
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.05)
    free = metric(http, "kvforge:kv_cache_free_blocks")
    assert free == metric(http, "kvforge:kv_cache_total_blocks"), "KV blocks leaked"
