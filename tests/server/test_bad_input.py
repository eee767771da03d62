"""Inputs that used to get a 500 or a misleading answer: lone surrogates, malformed JSON, a prompt that
alone overflows the context, the `Bearer` scheme in another case, and very large prompts (tokenized
off the event loop)."""

from __future__ import annotations

import threading

import pytest

from kvforge.tokenizer import Tokenizer
from tests.server.harness import API_KEY, MODEL_NAME, ServerThread, wait_idle
from tests.server.test_errors import AUTH, CHAT, COMPLETION, assert_error, post

SURROGATE = "\ud800"  # json.dumps writes it as the escape "\\ud800", as a client's JSON would


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {**COMPLETION, "prompt": SURROGATE}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": ["Hello", f"a{SURROGATE}b"]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "stop": SURROGATE}, "stop"),
    ("/v1/completions", {**COMPLETION, "stop": ["ok", SURROGATE]}, "stop"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": SURROGATE}]}, "messages"),
    ("/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, "messages"),
])
def test_lone_surrogates_are_400(tiny_server: ServerThread, path: str, body: dict, param: str) -> None:
    error = assert_error(post(tiny_server, path, body), 400, param)
    assert "surrogate" in error["message"]


def test_malformed_json_names_no_field(tiny_server: ServerThread) -> None:
    error = assert_error(post(tiny_server, "/v1/completions", b'{"prompt": "Hi",'), 400)
    assert error["param"] is None and "JSON" in error["message"]


def test_context_errors_name_the_field_at_fault(tiny_server: ServerThread) -> None:
    long_prompt = {**COMPLETION, "prompt": "fox " * 600}  # the tiny model's context is 512 tokens
    for body in (long_prompt, {**long_prompt, "max_tokens": None}):
        assert "the prompt has" in assert_error(post(tiny_server, "/v1/completions", body), 400, "prompt")["message"]
    error = assert_error(post(tiny_server, "/v1/completions", {**COMPLETION, "max_tokens": 600}), 400, "max_tokens")
    assert "lower max_tokens" in error["message"]


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer", "bEaReR"])
def test_bearer_scheme_is_case_insensitive(tiny_server: ServerThread, scheme: str) -> None:
    response = tiny_server.http.get("/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"})
    assert response.status_code == 200, response.text
    assert [m["id"] for m in response.json()["data"]] == [MODEL_NAME]


def test_unauthorized_says_the_scheme(tiny_server: ServerThread) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"}):
        response = tiny_server.http.get("/v1/models", headers=headers)
        assert_error(response, 401)
        assert response.headers["WWW-Authenticate"].startswith("Bearer")


def test_large_prompts_are_tokenized_off_the_event_loop(tiny_server: ServerThread,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The handlers run on the event loop's thread; a large prompt must be encoded (or templated)
    elsewhere, so /health and other requests are answered meanwhile."""
    threads: list[str] = []

    def recording(name: str):
        original = getattr(Tokenizer, name)

        def wrapper(*args, **kwargs):
            threads.append(threading.current_thread().name)
            return original(*args, **kwargs)
        monkeypatch.setattr(Tokenizer, name, wrapper)

    recording("encode")
    recording("apply_chat_template")
    big = "fox " * 50_000  # 200k characters, far beyond the context: the answer is a 400 about the prompt
    assert_error(post(tiny_server, "/v1/completions", {**COMPLETION, "prompt": big}), 400, "prompt")
    chat = {**CHAT, "messages": [{"role": "user", "content": big}]}
    assert_error(post(tiny_server, "/v1/chat/completions", chat), 400, "prompt")
    loop_thread = tiny_server.thread.name
    assert len(threads) >= 2 and loop_thread not in threads, threads
    threads.clear()
    assert post(tiny_server, "/v1/completions", COMPLETION).status_code == 200
    assert threads == [loop_thread]  # a small prompt is quicker encoded in place
    wait_idle(tiny_server.http)


def test_auth_header_is_checked_before_the_body(tiny_server: ServerThread) -> None:
    response = tiny_server.http.post("/v1/completions", content=b"{", headers={"Content-Type": "application/json"})
    assert_error(response, 401)
    assert_error(post(tiny_server, "/v1/completions", b"{", headers=AUTH), 400)


@pytest.mark.parametrize("path", ["/v1/embeddings", "/classify", "/rerank"])
def test_pooling_routes_name_the_runner_on_a_generating_server(tiny_server: ServerThread, path: str) -> None:
    body = {"input": "hello", "query": "a", "documents": ["b"]}
    error = assert_error(post(tiny_server, path, body), 400)
    assert "--runner pooling" in error["message"]
