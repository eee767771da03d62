"""The router in front of two real tiny-model servers (and one address where nothing listens), through the
official client: answers equal a replica's own, shared prefixes stay on one replica, streams pass through."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvforge.router.app import RouterConfig
from tests.router.harness import RouterThread
from tests.server.harness import MODEL_NAME, ServerThread, free_port, metric, start_tiny_server, wait_idle

SYSTEMS = ["You are a pirate. Always answer like a pirate would, with many arrs and mateys in every sentence. " * 2,
           "You are a librarian. Answer quietly and precisely, citing the shelf of every book you mention. " * 2]
QUESTIONS = ["Where is the sea?", "What is a ship?", "Who keeps the map?", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def replicas(tiny_llama_dir) -> Iterator[list[ServerThread]]:
    servers = [start_tiny_server(tiny_llama_dir[0], max_num_seqs=8) for _ in range(2)]
    yield servers
    for server in servers:
        server.stop()


def _router(replicas: list[ServerThread], policy: str, dead_url: str | None = None) -> RouterThread:
    backends = tuple(s.base_url for s in replicas) + ((dead_url,) if dead_url else ())
    router = RouterThread(RouterConfig(backends, policy=policy, health_interval=0.2))
    router.wait_healthy(len(replicas))
    return router


def _prefix_hits(replicas: list[ServerThread]) -> float:
    return sum(metric(s.http, "kvforge:prefix_cache_hits_total") for s in replicas)


def _run_workload(router: RouterThread, tag: str) -> list[str]:
    """Each system prompt's questions in turn (its first, both first ones, then the rest), greedy, 4 tokens."""
    client = router.openai_client()
    order = [(0, 0), (1, 0)] + [(s, q) for s in (0, 1) for q in range(1, len(QUESTIONS))]
    texts = []
    for s, q in order:
        prompt = f"{tag} {SYSTEMS[s]}\nQ: {QUESTIONS[q]}\nA:"
        answer = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0)
        texts.append(answer.choices[0].text)
    return texts


def test_prefix_routing_keeps_each_system_prompt_on_one_replica(replicas) -> None:
    dead_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there: taken out by the first health check
    router = _router(replicas, "prefix", dead_url)
    try:
        assert router.http.get("/health").json() == {"status": "ok", "healthy_replicas": 2, "replicas": 3}
        assert router.replica_metric("kvforge_router:replica_healthy", dead_url) == 0
        hits_before = _prefix_hits(replicas)
        texts = _run_workload(router, "prefix")
        prefix_hits = _prefix_hits(replicas) - hits_before
        requests = [router.replica_metric("kvforge_router:replica_requests_total", s.base_url) for s in replicas]
        assert requests == [len(QUESTIONS), len(QUESTIONS)]  # one system prompt each
    finally:
        router.stop()
    # the same workload straight to one replica: the answers a user gets without the router
    direct = replicas[0].openai_client()
    for text, (s, q) in zip(texts, [(0, 0), (1, 0)] + [(s, q) for s in (0, 1) for q in range(1, len(QUESTIONS))]):
        prompt = f"prefix {SYSTEMS[s]}\nQ: {QUESTIONS[q]}\nA:"
        answer = direct.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0)
        assert answer.choices[0].text == text
    router = _router(replicas, "round-robin")
    try:
        hits_before = _prefix_hits(replicas)
        _run_workload(router, "round-robin")
        round_robin_hits = _prefix_hits(replicas) - hits_before
    finally:
        router.stop()
    assert prefix_hits > round_robin_hits > 0  # round robin splits each system prompt over both replicas
    for server in replicas:
        wait_idle(server.http)


def test_streams_models_and_bad_bodies_pass_through(replicas) -> None:
    router = _router(replicas, "prefix")
    try:
        client = router.openai_client()
        messages = [{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": "Hello there"}]
        whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0)
        stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0,
                                                stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == whole.choices[0].message.content
        assert [m.id for m in client.models.list().data] == [MODEL_NAME]
        answer = router.http.post("/v1/completions", content=b"not json", headers={"Authorization": "Bearer x"})
        assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error"
        wrong_model = router.http.post("/v1/completions", json={"model": "nope", "prompt": "hi"},
                                       headers={"Authorization": "Bearer test-key"})
        assert wrong_model.status_code == 404 and "nope" in wrong_model.json()["error"]["message"]
    finally:
        router.stop()
