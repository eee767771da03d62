"""`kvforge serve --data-parallel-size 2` as a user runs it, and one replica killed mid-load: no request that had
not started is lost, started streams end with an error event (the official client raises), the router takes the
replica out and back in once it is running again."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.harness import API_KEY, free_port

pytestmark = pytest.mark.slow


def _healthy_replicas(http: httpx.Client) -> int:
    try:
        answer = http.get("/health")
    except httpx.TransportError:
        return -1
    return answer.json().get("healthy_replicas", 0) if answer.status_code == 200 else 0


def _wait(condition, timeout: float, what: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert server.poll() is None, f"the server exited with code {server.returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _replica_pids(log: Path) -> dict[str, int]:
    """URL -> the pid of the replica's latest process, from the command's log."""
    found = re.findall(r"replica on (http://[\d.:]+): pid (\d+)", log.read_text())
    return {url: int(pid) for url, pid in found}


def _stream(client: openai.OpenAI, outcomes: list, index: int) -> None:
    try:
        stream = client.completions.create(model="tiny", prompt=f"Story {index}: once upon a time", max_tokens=300,
                                           temperature=0, stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        outcomes[index] = ("done", [chunk.usage.completion_tokens for chunk in stream if chunk.usage][-1])
    except openai.APIError as error:
        outcomes[index] = ("error", str(error))


def _complete(client: openai.OpenAI, outcomes: list, index: int) -> None:
    try:
        answer = client.completions.create(model="tiny", prompt=f"Question {index}: why?", max_tokens=300,
                                           temperature=0, extra_body={"ignore_eos": True})
        outcomes[index] = ("done", answer.usage.completion_tokens)
    except openai.APIError as error:
        outcomes[index] = ("error", str(error))


def test_a_killed_replica_loses_no_unstarted_request(tiny_llama_dir, tmp_path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "kvforge.cli", "serve", str(tiny_llama_dir[0]), "--data-parallel-size", "2",
               "--port", str(port), "--api-key", API_KEY, "--served-model-name", "tiny", "--enforce-eager",
               "--kv-cache-memory", "64MiB", "--health-interval", "0.2", "--uvicorn-log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    with open(log, "w") as log_file:
        server = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
    try:
        _wait(lambda: _healthy_replicas(http) == 2, 300, "both replicas", server)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        victim_url, victim_pid = sorted(_replica_pids(log).items())[0]

        streams, completions = [None] * 8, [None] * 8
        threads = [threading.Thread(target=_stream, args=(client, streams, i)) for i in range(8)]
        threads += [threading.Thread(target=_complete, args=(client, completions, i)) for i in range(8)]
        for thread in threads:
            thread.start()
        time.sleep(1.5)  # the requests are spread over both replicas and running
        os.kill(victim_pid, signal.SIGKILL)
        for thread in threads:
            thread.join(timeout=120)
            assert not thread.is_alive(), "a request hung after its replica died"

        # every non-streamed request is answered in full (it is sent again to the other replica)
        assert completions == [("done", 300)] * 8, completions
        # a stream ends whole, or (if its replica died after its first event) with an error event
        assert all(kind == "done" and n == 300 or kind == "error" and "broke off" in n for kind, n in streams), streams
        assert any(kind == "error" for kind, _ in streams), "no stream ran on the killed replica"

        _wait(lambda: _healthy_replicas(http) == 2, 300, "the killed replica back in (started again)", server)
        assert _replica_pids(log)[victim_url] != victim_pid
        metrics = http.get("/metrics").text
        assert re.search(rf'kvforge_router:replica_failures_total{{replica="{victim_url}"}} [1-9]', metrics)
        assert re.search(r"kvforge_router:retries_total [1-9]", metrics)  # the victim's requests went elsewhere
        answers = [client.completions.create(model="tiny", prompt=f"After {i}", max_tokens=3).usage.completion_tokens
                   for i in range(4)]
        assert answers == [3] * 4
    finally:
        http.close()
        server.send_signal(signal.SIGTERM)
        try:
            assert server.wait(timeout=60) in (0, -signal.SIGTERM)  # as `kvforge serve` ends on SIGTERM
        finally:
            if server.poll() is None:
                server.kill()
    for pid in _replica_pids(log).values():  # no replica outlives the command
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
