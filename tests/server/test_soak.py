"""A bounded soak: mixed traffic against a server whose KV cache is small enough to force preemption.

Streaming and not, chat and completions, n > 1 with seeds, clients that hang up mid-stream, requests
aborted by a client timeout, bad requests, prompts that share a prefix. Afterwards every finished
output equals its quiet-run output (each request alone on the idle server), every KV block is free,
and the process's memory grew by a bounded amount.

KVFORGE_SOAK_SECONDS sets the traffic's duration (default 12 s, what the default suite can afford);
the figures of a longer run are in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from tests.server.harness import metric, start_tiny_server, wait_idle

SOAK_SECONDS = float(os.environ.get("KVFORGE_SOAK_SECONDS", "12"))
NUM_CLIENTS = 12
PREFIX = "You are a careful assistant. Answer in one short sentence. Question: "
QUESTIONS = ["why is the sky blue?", "what is a prime?", "who wrote Hamlet?", "how do bees fly?",
             "what is rust?", "why do cats purr?"]
BAD_BODIES = [{"prompt": "\ud800"}, {"prompt": "Hi", "max_tokens": 10**6}, {"prompt": "Hi", "temperature": -3},
              {"prompt": []}, {"messages": []}, {"prompt": "Hi", "n": 1000}]
MAX_RSS_GROWTH_BYTES = 200 * 2**20


@dataclass(frozen=True, slots=True)
class Spec:
    """One request's inputs: everything its output depends on."""

    chat: bool
    question: int
    max_tokens: int
    n: int  # n > 1 samples with a seed, else greedy

    def body(self, stream: bool) -> dict:
        body: dict = {"max_tokens": self.max_tokens, "stream": stream, "ignore_eos": True, "n": self.n}
        body.update({"temperature": 0.8, "seed": 1234} if self.n > 1 else {"temperature": 0})
        text = PREFIX + QUESTIONS[self.question]
        if self.chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        return body

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


SPECS = [Spec(chat, q, max_tokens, n) for chat in (False, True) for q in range(len(QUESTIONS))
         for max_tokens, n in ((8, 1), (40, 1), (24, 3))]


@dataclass(slots=True)
class Tally:
    served: int = 0
    streamed: int = 0
    hung_up: int = 0
    aborted: int = 0
    bad: int = 0
    mismatches: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def _texts(data: dict) -> list[str]:
    choices = sorted(data["choices"], key=lambda c: c["index"])
    return [c["message"]["content"] if "message" in c else c["text"] for c in choices]


async def _streamed_texts(response: httpx.Response, n: int, hang_up_after: int | None) -> list[str] | None:
    """The choices' texts from an event stream; None if we hung up first."""
    texts, num_events = [""] * n, 0
    async for line in response.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        num_events += 1
        if hang_up_after is not None and num_events > hang_up_after:
            return None
        for choice in json.loads(line[6:])["choices"]:
            text = (choice["delta"].get("content") or "") if "delta" in choice else choice["text"]
            texts[choice["index"]] += text
    return texts


async def _one(http: httpx.AsyncClient, rng: random.Random, quiet: dict[Spec, list[str]], tally: Tally) -> None:
    roll = rng.random()
    if roll < 0.1:
        content = json.dumps(rng.choice(BAD_BODIES)).encode()  # ASCII JSON: "\\ud800" as an escape
        response = await http.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
        tally.bad += 1
        if response.status_code != 400:
            tally.unexpected.append(f"bad request got {response.status_code}")
        return
    spec = rng.choice(SPECS)
    if roll < 0.2:  # aborted: the client gives up before the answer
        try:
            await http.post(spec.path, json=spec.body(stream=False), timeout=rng.uniform(0.05, 0.3))
        except httpx.TimeoutException:
            tally.aborted += 1
        return
    if roll < 0.6:
        hang_up_after = rng.randint(1, 4) if roll < 0.35 else None
        async with http.stream("POST", spec.path, json=spec.body(stream=True)) as response:
            if response.status_code != 200:
                tally.unexpected.append(f"stream got {response.status_code}")
                return
            texts = await _streamed_texts(response, spec.n, hang_up_after)
        if texts is None:
            tally.hung_up += 1
            return
        tally.streamed += 1
    else:
        response = await http.post(spec.path, json=spec.body(stream=False))
        if response.status_code != 200:
            tally.unexpected.append(f"request got {response.status_code}: {response.text[:200]}")
            return
        texts = _texts(response.json())
    tally.served += 1
    if texts != quiet[spec]:
        tally.mismatches.append(f"{spec}: {texts} != {quiet[spec]}")


async def _client(base_url: str, seed: int, deadline: float, quiet: dict[Spec, list[str]], tally: Tally) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        while asyncio.get_running_loop().time() < deadline:
            await _one(http, rng, quiet, tally)


def test_soak_mixed_traffic_with_preemption(tiny_model_dir: Path) -> None:
    # NOTE: eager steps: compiling a decode bucket takes seconds, which would fill the short soak of the
    # default suite (compiled steps are checked against eager ones in tests/executor/test_decode_graphs.py)
    server = start_tiny_server(tiny_model_dir, api_key=None, kv_cache_memory="256KiB", max_model_len=160,
                               enforce_eager=True)
    http = server.http
    try:
        quiet = {spec: _texts(http.post(spec.path, json=spec.body(stream=False)).json()) for spec in SPECS}
        wait_idle(http)
        rss_before = psutil.Process().memory_info().rss
        preemptions_before = metric(http, "kvforge:num_preemptions_total")
        tally = Tally()

        async def traffic() -> None:
            deadline = asyncio.get_running_loop().time() + SOAK_SECONDS
            await asyncio.gather(*(_client(server.base_url, seed, deadline, quiet, tally)
                                   for seed in range(NUM_CLIENTS)))

        asyncio.run(traffic())
        wait_idle(http, timeout=60)  # every block free again
        rss_after = psutil.Process().memory_info().rss
        preemptions = metric(http, "kvforge:num_preemptions_total") - preemptions_before
        free = metric(http, "kvforge:kv_cache_free_blocks")
        total = metric(http, "kvforge:kv_cache_total_blocks")
    finally:
        server.stop()
    print(f"\nsoak {SOAK_SECONDS:g} s, {NUM_CLIENTS} clients: served {tally.served} (streamed {tally.streamed}), "
          f"hung up {tally.hung_up}, aborted {tally.aborted}, bad {tally.bad}, preemptions {preemptions:g}, "
          f"mismatches {len(tally.mismatches)}, leaked blocks {total - free:g}, "
          f"RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB")
    assert not tally.unexpected, tally.unexpected[:5]
    assert not tally.mismatches, tally.mismatches[:3]
    assert tally.served > NUM_CLIENTS and tally.hung_up and tally.aborted and tally.bad
    assert preemptions > 0, "the KV cache was meant to be small enough to force preemption"
    assert rss_after - rss_before < MAX_RSS_GROWTH_BYTES
