"""64 concurrent streaming clients on the default model, served by `kvforge serve` in a subprocess.

Some clients hang up midway. Every stream that ran to its end must equal the non-streamed greedy
completion of its prompt, the requests must have shared batches, and afterwards every KV block is free.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.server.harness import free_port, metric, wait_idle

NUM_CLIENTS = 64
NUM_PROMPTS = 16
MAX_TOKENS = 16
TOPICS = ["the sea", "a city at night", "bread", "mountains", "a library", "rain", "chess", "the moon",
          "coffee", "a train journey", "winter", "music", "a garden", "the desert", "robots", "a lighthouse"]
PROMPTS = [f"Write one sentence about {topic}." for topic in TOPICS]


@pytest.fixture(scope="module")
def server_http() -> Iterator[httpx.Client]:
    port = free_port()
    command = [sys.executable, "-m", "kvforge.cli", "serve", "--port", str(port),
               "--served-model-name", "smol", "--uvicorn-log-level", "warning"]
    process = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, "kvforge serve exited"
            assert time.monotonic() < deadline, "kvforge serve did not come up"
            try:
                if http.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        yield http
    finally:
        http.close()
        process.terminate()
        process.wait(timeout=60)


async def _stream(client: openai.AsyncOpenAI, prompt: str,
                  hang_up_after: int | None) -> tuple[str, str | None]:
    stream = await client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0,
        stream=True)
    text, reason, num_chunks = "", None, 0
    async with stream:
        async for chunk in stream:
            num_chunks += 1
            for choice in chunk.choices:
                text += choice.delta.content or ""
                reason = choice.finish_reason or reason
            if hang_up_after is not None and num_chunks >= hang_up_after:
                return text, None  # leaving the `async with` closes the connection
    return text, reason


async def _run_clients(base_url: str, http: httpx.Client) -> tuple[list, list[tuple[str, str | None]], int]:
    """The non-streamed greedy answers (sent together), then the streaming clients, and the peak
    number of sequences that ran in one batch."""
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=300,
                                http_client=openai.DefaultAsyncHttpxClient(
                                    limits=httpx.Limits(max_connections=NUM_CLIENTS + 8)))
    peak_running = 0

    async def watch() -> None:
        nonlocal peak_running
        while True:
            running = await asyncio.to_thread(metric, http, "kvforge:num_requests_running")
            peak_running = max(peak_running, int(running))
            await asyncio.sleep(0.2)

    try:
        expected = await asyncio.gather(*(client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS, temperature=0)
            for p in PROMPTS))
        watcher = asyncio.ensure_future(watch())
        results = await asyncio.gather(*(
            _stream(client, PROMPTS[i % NUM_PROMPTS], hang_up_after=3 if i % 4 == 3 else None)
            for i in range(NUM_CLIENTS)))
        watcher.cancel()
    finally:
        await client.close()
    return expected, results, peak_running


def test_concurrent_streams_equal_greedy_results_and_free_every_block(server_http: httpx.Client) -> None:
    expected, results, peak_running = asyncio.run(_run_clients(str(server_http.base_url), server_http))
    wait_idle(server_http, timeout=60)
    num_complete = 0
    for i, (text, reason) in enumerate(results):
        if i % 4 == 3:
            continue  # this client hung up
        reference = expected[i % NUM_PROMPTS].choices[0]
        assert (text, reason) == (reference.message.content, reference.finish_reason), f"client {i}"
        num_complete += 1
    assert num_complete == NUM_CLIENTS * 3 // 4
    assert peak_running > NUM_PROMPTS, f"at most {peak_running} requests ever ran together"
