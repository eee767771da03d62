"""Every request field is honoured or refused: unknown fields are 400s, the ignored ones are named in a header,
and vLLM's structured_outputs, chat_template_kwargs, continue_final_message, echo, prompt_logprobs and
return_tokens_as_token_ids do what they say, through the official client on the tiny model."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from kvforge.server.request_fields import IGNORED_FIELDS_HEADER
from tests.server.harness import API_KEY, MODEL_NAME, ServerThread, start_tiny_server
from tests.server.test_errors import assert_error, post
from tests.tiny_models import CHAT_TEMPLATE

# The tiny model's template, plus what Qwen3's adds when a request turns thinking off.
THINKING_TEMPLATE = CHAT_TEMPLATE + (
    "{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}"
)
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir: tuple[Path, object], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    folder = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(tiny_llama_dir[0], folder)
    (folder / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    server = start_tiny_server(folder)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _chat(client: openai.OpenAI, **kwargs: object):
    return client.chat.completions.create(model=MODEL_NAME, **{"messages": HI, "max_tokens": 4, **kwargs})


def _complete(client: openai.OpenAI, **kwargs: object):
    return client.completions.create(model=MODEL_NAME, **{"prompt": "The quick brown", "max_tokens": 4, **kwargs})


@pytest.mark.parametrize("endpoint", [_chat, _complete])
def test_unknown_fields_are_400_naming_them_and_ignored_ones_are_named_in_a_header(client: openai.OpenAI,
                                                                                  endpoint) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        endpoint(client, extra_body={"temprature": 0.5})
    assert refused.value.param == "temprature"
    assert "Unrecognized request argument supplied: temprature" in refused.value.message
    raw = endpoint(client.with_raw_response, user="alice", extra_body={"service_tier": "auto", "ignore_eos": True})
    assert raw.headers[IGNORED_FIELDS_HEADER] == "user, service_tier"
    assert raw.parse().usage.completion_tokens == 4
    assert IGNORED_FIELDS_HEADER not in endpoint(client.with_raw_response).headers
    streamed = endpoint(client.with_raw_response, stream=True, extra_body={"store": True, "ignore_eos": True})
    assert streamed.headers[IGNORED_FIELDS_HEADER] == "store"
    assert [chunk.choices[0].finish_reason for chunk in streamed.parse() if chunk.choices][-1] == "length"


def test_structured_outputs_choice_and_regex_are_honoured(client: openai.OpenAI, server: ServerThread) -> None:
    choices = ["yes", "no", "maybe"]
    chat = _chat(client, n=4, temperature=1.0, seed=3, max_tokens=8,
                 extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.message.content in choices for c in chat.choices)
    completion = _complete(client, n=4, temperature=1.0, seed=3, max_tokens=12,
                           extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-c]{2}"}})
    assert all(re.fullmatch("[0-9]{3}-[a-c]{2}", c.text) for c in completion.choices)
    both = {"model": MODEL_NAME, "messages": HI, "structured_outputs": {"regex": "a", "choice": ["b"]}}
    assert_error(post(server, "/v1/chat/completions", both), 400, "structured_outputs")
    unknown = {**both, "structured_outputs": {"regexp": "a"}}
    assert_error(post(server, "/v1/chat/completions", unknown), 400, "structured_outputs")


def test_chat_template_kwargs_reach_the_template(client: openai.OpenAI, server: ServerThread) -> None:
    def num_prompt_tokens(**kwargs: object) -> int:
        return _chat(client, **kwargs).usage.prompt_tokens

    def tokenized(body: dict) -> int:
        return post(server, "/tokenize", {"add_special_tokens": False, **body}).json()["count"]

    rendered = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    no_thinking = num_prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert no_thinking == tokenized({"prompt": rendered + "<think>\n\n</think>\n\n"})
    assert tokenized({"messages": HI, "chat_template_kwargs": {"enable_thinking": False}}) == no_thinking
    thinking = num_prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert thinking == num_prompt_tokens() == tokenized({"prompt": rendered}) < no_thinking
    with pytest.raises(openai.BadRequestError) as refused:
        num_prompt_tokens(extra_body={"chat_template_kwargs": {"messages": []}})
    assert refused.value.param == "chat_template_kwargs"


def test_continue_final_message_and_echo(client: openai.OpenAI, server: ServerThread) -> None:
    messages = [*HI, {"role": "assistant", "content": "The answer is"}]
    kwargs = {"messages": messages, "extra_body": {"continue_final_message": True, "add_generation_prompt": False,
                                                   "echo": True}}
    reply = _chat(client, temperature=0, **kwargs)
    open_prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nThe answer is"
    assert reply.usage.prompt_tokens == post(server, "/tokenize", {"prompt": open_prompt,
                                                                    "add_special_tokens": False}).json()["count"]
    completion = _complete(client, prompt=open_prompt, temperature=0)
    assert reply.choices[0].message.content == "The answer is" + completion.choices[0].text
    streamed = _chat(client, temperature=0, stream=True, **kwargs)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed) == reply.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as refused:  # add_generation_prompt is true by default
        _chat(client, messages=messages, extra_body={"continue_final_message": True})
    assert refused.value.param == "continue_final_message"


def test_return_tokens_as_token_ids(client: openai.OpenAI, server: ServerThread) -> None:
    def ids(names: list[str], text: str, num_tokens: int) -> None:
        """names are token_id:N, N the generated tokens' ids: as many, and they decode to the text (which
        holds back a trailing incomplete character)."""
        token_ids = [int(re.fullmatch(r"token_id:(\d+)", name).group(1)) for name in names]
        assert len(token_ids) == num_tokens
        assert post(server, "/detokenize", {"tokens": token_ids}).json()["prompt"].startswith(text)

    as_ids = {"return_tokens_as_token_ids": True}
    chat = _chat(client, temperature=0, logprobs=True, top_logprobs=2, extra_body=as_ids)
    entries = chat.choices[0].logprobs.content
    ids([e.token for e in entries], chat.choices[0].message.content, chat.usage.completion_tokens)
    ids([top.token for e in entries for top in e.top_logprobs], "", 2 * len(entries))
    plain = _chat(client, temperature=0, logprobs=True, top_logprobs=2)
    assert [e.logprob for e in entries] == [e.logprob for e in plain.choices[0].logprobs.content]
    completion = _complete(client, temperature=0, logprobs=2, extra_body=as_ids)
    logprobs = completion.choices[0].logprobs
    ids(logprobs.tokens, completion.choices[0].text, completion.usage.completion_tokens)
    assert all(re.fullmatch(r"token_id:\d+", key) for top in logprobs.top_logprobs for key in top)
    assert logprobs.token_logprobs == _complete(client, temperature=0, logprobs=2).choices[0].logprobs.token_logprobs


def test_prompt_logprobs_match_the_reference_model(client: openai.OpenAI, server: ServerThread,
                                                   tiny_llama_dir: tuple[Path, object]) -> None:
    completion = _complete(client, max_tokens=1, extra_body={"prompt_logprobs": 2})
    prompt_ids = post(server, "/tokenize", {"prompt": "The quick brown"}).json()["tokens"]
    positions = completion.choices[0].prompt_logprobs
    assert len(positions) == len(prompt_ids) and positions[0] is None
    with torch.no_grad():  # the reference: transformers' logits of the same prompt
        logits = tiny_llama_dir[1](torch.tensor([prompt_ids])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)
    for i, (token_id, position) in enumerate(zip(prompt_ids[1:], positions[1:], strict=True), start=1):
        assert position[str(token_id)]["logprob"] == pytest.approx(expected[i - 1, token_id].item(), abs=1e-3)
        top = max(position.values(), key=lambda lp: lp["logprob"])
        assert top["rank"] == 1 and top["logprob"] == pytest.approx(expected[i - 1].max().item(), abs=1e-3)
    chat = _chat(client, max_tokens=1, extra_body={"prompt_logprobs": 0})
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(client, stream=True, extra_body={"prompt_logprobs": 1})
    assert refused.value.param == "prompt_logprobs"
