"""Every request field is honoured or refused: each field vLLM's and OpenAI's request models define gets the answer
listed for it, unknown fields are 400s, the ignored ones are named in a header, and vLLM's structured_outputs,
chat_template_kwargs, continue_final_message, echo, prompt_logprobs and return_tokens_as_token_ids do what they say,
through the official client on the tiny model."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from kvforge.server.request_fields import IGNORED_FIELDS_HEADER
from tests.server.harness import MODEL_NAME, ServerThread, start_tiny_server
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
    return server.openai_client()


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


# Every field vLLM's CompletionRequest and ChatCompletionRequest define (vLLM's docs: the OpenAI fields, its sampling
# and extra parameters, the guided_* names of older releases), and OpenAI's own, with a value that is not the default
# and what kvforge does with it: honoured, ignored (named in the header), or refused (a 400 naming it).
HONOURED, IGNORED, REFUSED = "honoured", "ignored", "refused"
SHARED_FIELDS: dict[str, tuple[dict, str]] = {
    "frequency_penalty": ({"frequency_penalty": 0.5}, HONOURED),
    "logit_bias": ({"logit_bias": {"5": 1.0}}, HONOURED),
    "n": ({"n": 2}, HONOURED),
    "presence_penalty": ({"presence_penalty": 0.5}, HONOURED),
    "seed": ({"seed": 7}, HONOURED),
    "stop": ({"stop": ["zz"]}, HONOURED),
    "stream": ({"stream": True}, HONOURED),
    "stream_options": ({"stream": True, "stream_options": {"include_usage": True}}, HONOURED),
    "temperature": ({"temperature": 0.5}, HONOURED),
    "top_p": ({"top_p": 0.9}, HONOURED),
    "user": ({"user": "alice"}, IGNORED),
    "use_beam_search": ({"use_beam_search": True}, REFUSED),
    "top_k": ({"top_k": 5}, HONOURED),
    "min_p": ({"min_p": 0.1}, HONOURED),
    "repetition_penalty": ({"repetition_penalty": 1.1}, HONOURED),
    "length_penalty": ({"length_penalty": 0.5}, REFUSED),
    "stop_token_ids": ({"stop_token_ids": [5]}, HONOURED),
    "include_stop_str_in_output": ({"include_stop_str_in_output": True}, HONOURED),
    "ignore_eos": ({"ignore_eos": True}, HONOURED),
    "min_tokens": ({"min_tokens": 1}, HONOURED),
    "skip_special_tokens": ({"skip_special_tokens": False}, HONOURED),
    "spaces_between_special_tokens": ({"spaces_between_special_tokens": False}, REFUSED),
    "truncate_prompt_tokens": ({"truncate_prompt_tokens": 3}, REFUSED),
    "allowed_token_ids": ({"allowed_token_ids": [5, 6]}, REFUSED),
    "prompt_logprobs": ({"prompt_logprobs": 1}, HONOURED),
    "bad_words": ({"bad_words": ["fox"]}, REFUSED),
    "add_special_tokens": ({"add_special_tokens": False}, REFUSED),
    "structured_outputs": ({"structured_outputs": {"choice": ["a", "b"]}}, HONOURED),
    "guided_json": ({"guided_json": {"type": "object"}}, HONOURED),
    "guided_regex": ({"guided_regex": "[ab]+"}, HONOURED),
    "guided_choice": ({"guided_choice": ["a", "b"]}, HONOURED),
    "guided_grammar": ({"guided_grammar": 'root ::= "a" "b"'}, HONOURED),
    "guided_decoding_backend": ({"guided_decoding_backend": "xgrammar"}, REFUSED),
    "guided_whitespace_pattern": ({"guided_whitespace_pattern": " ?"}, REFUSED),
    "logits_processors": ({"logits_processors": ["x"]}, REFUSED),
    "priority": ({"priority": 1}, IGNORED),
    "request_id": ({"request_id": "mine"}, IGNORED),
    "return_tokens_as_token_ids": ({"return_tokens_as_token_ids": True}, HONOURED),
    "return_token_ids": ({"return_token_ids": True}, REFUSED),
    "cache_salt": ({"cache_salt": "salt"}, IGNORED),
    "kv_transfer_params": ({"kv_transfer_params": {}}, REFUSED),
    "vllm_xargs": ({"vllm_xargs": {"a": 1}}, REFUSED),
}
COMPLETION_FIELDS: dict[str, tuple[dict, str]] = {
    **SHARED_FIELDS,
    "echo": ({"echo": True}, HONOURED),
    "logprobs": ({"logprobs": 1}, HONOURED),
    "max_tokens": ({"max_tokens": 0}, HONOURED),
    "suffix": ({"suffix": "x"}, REFUSED),  # for this model, which has no fill-in-the-middle tokens
    "best_of": ({"best_of": 2}, HONOURED),
    "response_format": ({"response_format": {"type": "json_object"}}, REFUSED),
    "prompt_embeds": ({"prompt_embeds": "AAAA"}, REFUSED),
}
CHAT_FIELDS: dict[str, tuple[dict, str]] = {
    **SHARED_FIELDS,
    "logprobs": ({"logprobs": True}, HONOURED),
    "top_logprobs": ({"logprobs": True, "top_logprobs": 2}, HONOURED),
    "max_tokens": ({"max_tokens": 1}, HONOURED),
    "max_completion_tokens": ({"max_completion_tokens": 1}, HONOURED),
    "response_format": ({"response_format": {"type": "json_object"}}, HONOURED),
    "tools": ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
              HONOURED),
    "tool_choice": ({"tool_choice": "none"}, HONOURED),
    "parallel_tool_calls": ({"parallel_tool_calls": False}, HONOURED),
    "reasoning_effort": ({"reasoning_effort": "low"}, REFUSED),
    "include_reasoning": ({"include_reasoning": False}, REFUSED),
    "echo": ({"echo": True}, HONOURED),
    "add_generation_prompt": ({"add_generation_prompt": False}, HONOURED),
    "continue_final_message": ({"continue_final_message": True, "add_generation_prompt": False,
                                "messages": [*HI, {"role": "assistant", "content": "Well"}]}, HONOURED),
    "documents": ({"documents": [{"title": "t", "text": "x"}]}, REFUSED),
    "chat_template": ({"chat_template": "{{ messages }}"}, REFUSED),
    "chat_template_kwargs": ({"chat_template_kwargs": {"enable_thinking": False}}, HONOURED),
    "mm_processor_kwargs": ({"mm_processor_kwargs": {}}, REFUSED),
    "store": ({"store": True}, IGNORED),
    "metadata": ({"metadata": {"k": "v"}}, IGNORED),
    "service_tier": ({"service_tier": "auto"}, IGNORED),
    "modalities": ({"modalities": ["text", "audio"]}, REFUSED),
    "audio": ({"audio": {"voice": "alloy", "format": "wav"}}, REFUSED),
    "prediction": ({"prediction": {"type": "content", "content": "x"}}, REFUSED),
    "web_search_options": ({"web_search_options": {}}, REFUSED),
    "functions": ({"functions": [{"name": "f"}]}, REFUSED),
    "function_call": ({"function_call": "auto"}, REFUSED),
}


@pytest.mark.parametrize(("path", "base", "fields"), [
    ("/v1/completions", {"prompt": "The quick brown", "max_tokens": 2}, COMPLETION_FIELDS),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 2}, CHAT_FIELDS),
])
def test_every_field_of_the_vllm_and_openai_requests_is_honoured_ignored_or_refused(
        server: ServerThread, path: str, base: dict, fields: dict[str, tuple[dict, str]]) -> None:
    wrong = []
    for field, (fragment, verdict) in fields.items():
        response = post(server, path, {"model": MODEL_NAME, **base, **fragment})
        ignored = response.headers.get(IGNORED_FIELDS_HEADER, "").split(", ")
        if response.status_code == 400:
            got = REFUSED if response.json()["error"]["param"] == field else f"400 on {response.json()['error']}"
        elif response.status_code == 200:
            got = IGNORED if field in ignored else HONOURED
        else:
            got = f"{response.status_code}: {response.text[:200]}"
        if got != verdict:
            wrong.append(f"{field}: {verdict} expected, got {got}")
    assert not wrong


def test_the_stop_token_that_ends_a_reply_is_not_its_text(client: openai.OpenAI) -> None:
    eos = 2  # the tiny tokenizer's </s>
    ended = _complete(client, logit_bias={str(eos): 100}, extra_body={"skip_special_tokens": False}).choices[0]
    assert ended.finish_reason == "stop" and ended.text == ""
    included = _complete(client, logit_bias={str(eos): 100},
                         extra_body={"skip_special_tokens": False, "include_stop_str_in_output": True}).choices[0]
    assert included.text == "</s>"
