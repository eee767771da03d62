"""Admission control: `max_queue` bounds the sequences waiting beyond the batch's slots, a request's n
samples together. A burst that fits the batch is admitted whole; beyond slots + queue the answer is a
503 with Retry-After (and the admitted requests are still right); a request that could never be
admitted is a 400."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvforge.llm import LLM
from kvforge.sampling_params import SamplingParams
from tests.server.harness import ServerThread, metric, start_tiny_server, wait_idle
from tests.server.test_errors import assert_error

PROMPTS = ["Hi", "Hello there", "The quick brown fox", "Paris is the capital of", "def add(a, b):"]
MAX_TOKENS = 8
NUM_BURST = 150


@pytest.fixture(scope="module")
def roomy_server(tiny_model_dir: Path) -> Iterator[ServerThread]:
    """256 batch slots (the default) and a queue of 64."""
    server = start_tiny_server(tiny_model_dir, max_queue=64, api_key=None)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def small_server(tiny_model_dir: Path) -> Iterator[ServerThread]:
    """4 batch slots and a queue of 4: at most 8 sequences admitted at once."""
    server = start_tiny_server(tiny_model_dir, max_queue=4, api_key=None, max_num_seqs=4)
    yield server
    server.stop()


def _greedy(llm: LLM, max_tokens: int) -> dict[str, str]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True)}


def _body(prompt: str | list[str], **fields: object) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **fields}


def _burst(server: ServerThread, bodies: list[dict]) -> list[httpx.Response]:
    async def send_all() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=len(bodies))  # every request in flight at once
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for body in bodies))

    return asyncio.run(send_all())


def test_a_burst_that_fits_the_batch_is_admitted_whole(roomy_server: ServerThread, tiny_llm: LLM) -> None:
    greedy_texts = _greedy(tiny_llm, MAX_TOKENS)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(NUM_BURST)]
    responses = _burst(roomy_server, [_body(p) for p in prompts])
    assert [r.status_code for r in responses] == [200] * NUM_BURST
    assert [r.json()["choices"][0]["text"] for r in responses] == [greedy_texts[p] for p in prompts]
    assert metric(roomy_server.http, 'kvforge:request_rejected_total{reason="queue_full"}') == 0
    wait_idle(roomy_server.http)


def test_n_samples_of_several_prompts_count_together(roomy_server: ServerThread) -> None:
    """2 prompts x 64 samples = 128 sequences: more than the queue of 64, but they fit the batch."""
    response = roomy_server.http.post("/v1/completions", json=_body(["Hi", "Hello"], n=64, temperature=1.0))
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert sorted(c["index"] for c in choices) == list(range(128))
    wait_idle(roomy_server.http)


def test_beyond_slots_and_queue_is_503_with_retry_after(small_server: ServerThread, tiny_llm: LLM) -> None:
    greedy_texts = _greedy(tiny_llm, 32)
    http = small_server.http
    rejected_before = metric(http, 'kvforge:request_rejected_total{reason="queue_full"}')
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(NUM_BURST)]
    responses = _burst(small_server, [_body(p, max_tokens=32) for p in prompts])
    statuses = [r.status_code for r in responses]
    assert set(statuses) == {200, 503}, statuses
    assert statuses.count(200) >= 8  # the first 4 + 4 at least; more once some have finished
    for prompt, response in zip(prompts, responses, strict=True):
        if response.status_code == 503:
            assert_error(response, 503)
            assert int(response.headers["Retry-After"]) >= 1
        else:  # admitted: the greedy text, whatever happened around it
            assert response.json()["choices"][0]["text"] == greedy_texts[prompt]
    rejected = metric(http, 'kvforge:request_rejected_total{reason="queue_full"}') - rejected_before
    assert rejected == statuses.count(503)
    wait_idle(http)


def test_a_request_that_can_never_fit_is_400(small_server: ServerThread) -> None:
    http = small_server.http
    before = metric(http, 'kvforge:request_rejected_total{reason="never_fits"}')
    for body in (_body("Hi", n=9), _body(["Hi", "Hello", "Hey"], n=3)):  # 9 sequences > 4 slots + 4 queued
        error = assert_error(http.post("/v1/completions", json=body), 400, "n")
        assert "at most 8" in error["message"]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "n": 9}
    assert_error(http.post("/v1/chat/completions", json=chat), 400, "n")
    assert metric(http, 'kvforge:request_rejected_total{reason="never_fits"}') == before + 3
    response = http.post("/v1/completions", json=_body("Hi", n=8, temperature=1.0))  # exactly slots + queue
    assert response.status_code == 200 and len(response.json()["choices"]) == 8
    wait_idle(http)


def test_queue_depth_is_in_metrics(small_server: ServerThread) -> None:
    """6 long sequences on 4 slots: 2 wait, and /metrics says so."""
    http = small_server.http
    assert metric(http, "kvforge:admission_queue_limit") == 4

    async def run() -> list[float]:
        depths = []
        async with httpx.AsyncClient(base_url=small_server.base_url, timeout=120) as client:
            body = _body("Hi", n=3, max_tokens=200, temperature=1.0)
            sent = [asyncio.ensure_future(client.post("/v1/completions", json=body)) for _ in range(2)]
            for _ in range(400):
                depths.append(metric(http, "kvforge:admission_queue_depth"))
                if depths[-1] == 2:
                    break
                await asyncio.sleep(0.01)
            await asyncio.gather(*sent)
        return depths

    assert 2 in asyncio.run(run())
    assert metric(http, "kvforge:admission_queue_depth") == 0
    wait_idle(http)
