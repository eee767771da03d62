"""`kvforge serve --data-parallel-size 2` as a user runs it, with the replicas as local processes and as Ray actors
(`--data-parallel-backend ray`, on a local Ray cluster the command starts): greedy answers through the endpoint
are the single engine's, and one replica killed mid-load loses no request that had not started, started streams
end with an error event (the official client raises), the router takes the replica out and back in once it is
running again; no replica outlives the command."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from kvforge import LLM, SamplingParams
from tests.server.harness import API_KEY, free_port

pytestmark = pytest.mark.slow

BACKENDS = ["mp", pytest.param("ray", marks=pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                                                reason="the ray backend needs Ray installed"))]


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


@contextmanager
def _serve(folder: Path, log: Path, backend: str) -> Iterator[tuple[subprocess.Popen, httpx.Client, openai.OpenAI]]:
    """`kvforge serve --data-parallel-size 2` with both replicas in; at the end SIGTERM, and no replica left."""
    port = free_port()
    command = [sys.executable, "-m", "kvforge.cli", "serve", str(folder), "--data-parallel-size", "2",
               "--data-parallel-backend", backend, "--port", str(port), "--api-key", API_KEY,
               "--served-model-name", "tiny", "--enforce-eager", "--kv-cache-memory", "64MiB",
               "--health-interval", "0.2", "--uvicorn-log-level", "warning"]
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}  # ray: a local cluster
    env["PYTHONPATH"] = str(Path(__file__).parents[2])
    with open(log, "w") as log_file:
        server = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
    try:
        _wait(lambda: _healthy_replicas(http) == 2, 300, "both replicas", server)
        yield server, http, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0,
                                          timeout=120)
    finally:
        http.close()
        server.send_signal(signal.SIGTERM)
        try:
            assert server.wait(timeout=60) in (0, -signal.SIGTERM), log.read_text()[-3000:]
        finally:
            if server.poll() is None:
                server.kill()
    for pid in _replica_pids(log).values():  # no replica outlives the command
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_replicas_answer_as_the_single_engine(tiny_llama_dir, tmp_path, backend: str) -> None:
    prompts = ["The quick brown fox", "Paris is the capital", "def add(a, b):", "Large language models"]
    llm = LLM(str(tiny_llama_dir[0]), kv_cache_memory="16MiB")
    try:
        expected = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0,
                                                                                    ignore_eos=True))]
    finally:
        llm.shutdown()
    log = tmp_path / "serve.log"
    with _serve(tiny_llama_dir[0], log, backend) as (_, http, client):
        texts = [client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
        metrics = http.get("/metrics").text
    assert texts == expected
    urls = list(_replica_pids(log))
    assert len(urls) == 2
    for url in urls:  # the four prompts share no prefix: the router spreads them over both replicas
        assert re.search(rf'kvforge_router:replica_requests_total{{replica="{re.escape(url)}"}} 2\.0', metrics)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_killed_replica_loses_no_unstarted_request(tiny_llama_dir, tmp_path, backend: str) -> None:
    log = tmp_path / "serve.log"
    with _serve(tiny_llama_dir[0], log, backend) as (server, http, client):
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
