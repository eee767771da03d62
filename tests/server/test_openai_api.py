"""The OpenAI API through the official `openai` client against the real server on a tiny random Llama."""

from __future__ import annotations

import httpx
import openai
import pytest

import kvforge
from kvforge.llm import LLM
from kvforge.sampling_params import SamplingParams
from tests.server.harness import API_KEY, MODEL_NAME, ServerThread, metric, wait_idle

PROMPTS = ["The quick brown fox", "Paris is the capital of", "def add(a, b):\n    return"]


def _stream_text(chunks: list, n: int = 1) -> tuple[list[str], list[str | None]]:
    texts, reasons = [""] * n, [None] * n
    for chunk in chunks:
        for choice in chunk.choices:
            text = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            texts[choice.index] += text
            if choice.finish_reason is not None:
                assert reasons[choice.index] is None, "finish_reason sent twice"
                reasons[choice.index] = choice.finish_reason
    return texts, reasons


def test_models_and_health(client: openai.OpenAI, tiny_server: ServerThread) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("no-such-model")
    assert tiny_server.http.get("/health").status_code == 200
    assert tiny_server.http.get("/version").json() == {"version": kvforge.__version__}


def test_greedy_completions_equal_llm_generate(client: openai.OpenAI, tiny_llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12)
    expected = tiny_llm.generate(PROMPTS, params)
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in response.choices] == [o.outputs[0].text for o in expected]
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert response.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
    assert response.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in expected)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    # The same prompts as token ids, one list and a list of lists, give the same completions.
    ids = [o.prompt_token_ids for o in expected]
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=12, temperature=0)
    assert [c.text for c in by_ids.choices] == [c.text for c in response.choices]
    one = client.completions.create(model=MODEL_NAME, prompt=ids[1], max_tokens=12, temperature=0)
    assert one.choices[0].text == response.choices[1].text


def test_greedy_chat_equals_llm_chat(client: openai.OpenAI, tiny_llm: LLM) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a capital."}]
    expected = tiny_llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=10))[0]
    response = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10,
                                              temperature=0)
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_streamed_completion_equals_non_streamed(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, prompt=PROMPTS[:2], max_tokens=20, temperature=0, n=2, echo=True)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    texts, reasons = _stream_text(chunks[:-1], n=4)
    assert texts == [c.text for c in full.choices]
    assert reasons == [c.finish_reason for c in full.choices]
    assert texts[0].startswith(PROMPTS[0]) and texts[2].startswith(PROMPTS[1])
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_streamed_chat_equals_non_streamed(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Hello there"}], max_tokens=16,
                  temperature=0.8, seed=3, n=3)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    roles = [(c.choices[0].index, c.choices[0].delta.role)
             for c in chunks if c.choices and c.choices[0].delta.role]
    assert roles == [(0, "assistant"), (1, "assistant"), (2, "assistant")]
    texts, reasons = _stream_text(chunks[:-1], n=3)
    assert texts == [c.message.content for c in full.choices]
    assert reasons == [c.finish_reason for c in full.choices]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_seeds_are_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> list[str]:
        response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=16,
                                             temperature=1.0, n=2, seed=seed)
        return [c.text for c in response.choices]

    first = sample(11)
    assert sample(11) == first
    assert first[0] != first[1], "the n samples of one request should differ"
    assert sample(12) != first


def test_stop_strings_cut_the_text(client: openai.OpenAI) -> None:
    base = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=16, temperature=0)
    text = base.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"pick a visible stop string from {text!r}"
    expected = text[: text.index(stop)]
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                         stop=[stop, "never-appears"])
    assert response.choices[0].text == expected
    assert response.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                            stop=stop, stream=True))
    assert _stream_text(chunks) == ([expected], ["stop"])


def test_completion_logprobs(client: openai.OpenAI) -> None:
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                         logprobs=3)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == response.usage.completion_tokens == 8
    rows = zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True)
    for token, logprob, top in rows:
        assert 1 <= len(top) <= 4 and logprob <= 0.0  # fewer when tokens share a text
        assert logprob == pytest.approx(max(top.values()))  # greedy: the chosen token is the most likely
        assert top[token] == pytest.approx(logprob)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(8)]

    echoed = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                       logprobs=1, echo=True)
    echoed_logprobs = echoed.choices[0].logprobs
    assert len(echoed_logprobs.tokens) == echoed.usage.prompt_tokens + 8
    assert echoed_logprobs.token_logprobs[0] is None and echoed_logprobs.top_logprobs[0] is None
    assert all(lp is not None for lp in echoed_logprobs.token_logprobs[1:])
    assert echoed_logprobs.token_logprobs[-8:] == pytest.approx(logprobs.token_logprobs)


def test_chat_logprobs(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0,
                  logprobs=True, top_logprobs=2)
    response = client.chat.completions.create(**kwargs)
    content = response.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.bytes == list(entry.token.encode())
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    def pairs(entries: list) -> list[tuple[str, float]]:
        return [(e.token, round(e.logprob, 4)) for e in entries]

    assert pairs(streamed) == pairs(content)


def test_disconnected_clients_abort_their_requests(tiny_server: ServerThread) -> None:
    http, headers = tiny_server.http, {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True,
            "temperature": 0}
    wait_idle(http)
    before = metric(http, "kvforge:generation_tokens_total")
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}, headers=headers) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
        http.post("/v1/completions", json=body, headers=headers, timeout=0.05)
    wait_idle(http)
    assert metric(http, "kvforge:generation_tokens_total") - before < 2 * 400, "the requests ran to the end"
