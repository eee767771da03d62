"""The router served by uvicorn in a thread, in front of test servers."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import uvicorn

from kvforge.router.app import RouterConfig, build_router_app
from tests.server.harness import API_KEY, free_port


class RouterThread:
    """build_router_app(config) served on a free loopback port until stop()."""

    def __init__(self, config: RouterConfig) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.app = build_router_app(config)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                   timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.http = httpx.Client(base_url=self.base_url, timeout=60)
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the router did not start"
            time.sleep(0.02)

    def openai_client(self, timeout: float = 60) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=timeout)

    def replica_metric(self, name: str, url: str) -> float:
        """One per-replica sample of the router's /metrics, e.g. ('kvforge_router:replica_requests_total', url)."""
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(f'{name}{{replica="{url}"}} '):
                return float(line.split()[-1])
        raise AssertionError(f"{name} of {url} is not in the router's /metrics")

    def wait_healthy(self, count: int, timeout: float = 30.0) -> None:
        """Wait until the router counts `count` healthy replicas."""
        deadline = time.monotonic() + timeout
        while True:
            answer = self.http.get("/health")
            num_healthy = answer.json().get("healthy_replicas", 0) if answer.status_code == 200 else 0
            if num_healthy == count:
                return
            assert time.monotonic() < deadline, f"{num_healthy} healthy replicas, not {count}"
            time.sleep(0.1)

    def stop(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(timeout=30)
