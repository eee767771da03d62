"""The rest of the OpenAI surface on the tiny random model: grammar errors are 400s that leave the batch
alone, logit_bias, tool_choice auto, /tokenize and /detokenize."""

from __future__ import annotations

import json
import threading

import openai
import pytest

from kvforge.llm import LLM
from kvforge.sampling_params import SamplingParams
from kvforge.tokenizer import Tokenizer
from tests.server.harness import MODEL_NAME, ServerThread
from tests.server.test_errors import assert_error, post

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["id"]}}}


@pytest.mark.parametrize(("body", "param", "words"), [
    ({**CHAT, "guided_grammar": 'root ::= "a" ('}, None, "grammar cannot be compiled"),
    ({**CHAT, "guided_regex": "a(b"}, None, "regex cannot be compiled"),
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, None, "uniqueItems"),
    ({**CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope'"),
    ({**CHAT, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({**CHAT, "guided_regex": "a", "guided_choice": ["b"]}, None, "one output constraint"),
])
def test_bad_constraints_are_400_and_the_batch_goes_on(tiny_server: ServerThread, client: openai.OpenAI,
                                                       body: dict, param: str | None, words: str) -> None:
    kwargs = dict(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=24, temperature=0,
                  extra_body={"ignore_eos": True})
    alone = client.completions.create(**kwargs).choices[0].text
    texts: list[str] = []
    running = threading.Thread(target=lambda: texts.append(client.completions.create(**kwargs).choices[0].text))
    running.start()
    error = assert_error(post(tiny_server, "/v1/chat/completions", body), 400, param)
    running.join()
    assert words in error["message"]
    assert texts == [alone]


def test_logit_bias_forces_and_bans_tokens(client: openai.OpenAI, tiny_llm: LLM, tiny_model_dir) -> None:
    token_id = Tokenizer.from_dir(tiny_model_dir).encode(" fox", add_special_tokens=False)[0]
    kwargs = dict(model=MODEL_NAME, prompt="Hello", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    forced = client.completions.create(**kwargs, logit_bias={str(token_id): 100}, logprobs=0)
    assert forced.choices[0].logprobs.tokens == [" fox"] * 5
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    plain = tiny_llm.generate("Hello", params)[0].outputs[0].token_ids
    banned = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logit_bias=dict.fromkeys(plain, -100))
    assert not set(tiny_llm.generate("Hello", banned)[0].outputs[0].token_ids) & set(plain)


def test_auto_tool_choice_gives_a_valid_call_or_text(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Look up 3"}],
                                              tools=[TOOL], max_tokens=40, temperature=1.0, seed=1, n=4)
    for choice in response.choices:
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            assert 0 <= json.loads(choice.message.tool_calls[0].function.arguments)["id"] <= 9
        else:
            assert not choice.message.content.startswith("<")


def test_tokenize_and_detokenize(tiny_server: ServerThread, tiny_model_dir) -> None:
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    response = post(tiny_server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["tokens"] == tokenizer.encode("Hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512 and body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    messages = [{"role": "user", "content": "Hello"}]
    chat = post(tiny_server, "/tokenize", {"model": MODEL_NAME, "messages": messages}).json()
    assert chat["tokens"] == tokenizer.apply_chat_template(messages, tokenize=True)
    back = post(tiny_server, "/detokenize", {"tokens": body["tokens"]}).json()
    assert back == {"prompt": tokenizer.decode(body["tokens"])}
    assert_error(post(tiny_server, "/detokenize", {"tokens": [10**9]}), 400, "tokens")
    assert_error(post(tiny_server, "/tokenize", {"model": "other", "prompt": "x"}), 404, "model")
