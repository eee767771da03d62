"""Fixtures: a tiny random Llama served by the real app (uvicorn in a thread) on a free loopback port."""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

# NOTE: tests/ is not a package; put the repository root on the path for `tests.tiny_models`.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvforge.engine.async_engine import AsyncEngine  # noqa: E402
from kvforge.engine.llm_engine import LLMEngine  # noqa: E402
from kvforge.engine_args import build_engine_config  # noqa: E402
from kvforge.server.app import ServerConfig, build_app  # noqa: E402
from tests.tiny_models import save_model  # noqa: E402

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
        app = build_app(engine, config)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def metric(base_url: str, name: str) -> float:
    """One sample of /metrics, by its exposed name (e.g. 'kvforge:kv_cache_free_blocks')."""
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} is not in /metrics")


def wait_idle(base_url: str, timeout: float = 30.0) -> None:
    """Wait until no sequence runs or waits, then check every KV block is free again."""
    deadline = time.monotonic() + timeout
    while metric(base_url, "kvforge:num_requests_running") + metric(base_url, "kvforge:num_requests_waiting"):
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.05)
    free = metric(base_url, "kvforge:kv_cache_free_blocks")
    assert free == metric(base_url, "kvforge:kv_cache_total_blocks"), "KV blocks leaked"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_model(folder, "llama")
    return folder


def start_tiny_server(model_dir: Path, max_queue: int = 1024, api_key: str | None = API_KEY,
                      **engine_kwargs: object) -> ServerThread:
    engine = LLMEngine(build_engine_config(model=str(model_dir), kv_cache_memory="64MiB", **engine_kwargs))
    return ServerThread(AsyncEngine(engine, max_queue=max_queue), ServerConfig((MODEL_NAME,), api_key=api_key))


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir: Path) -> Iterator[ServerThread]:
    server = start_tiny_server(tiny_model_dir)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def client(tiny_server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
