"""Mistral's tool calls through the official `openai` client, on the tiny model given Mistral's special tokens and a
template of each of Mistral's two call formats ([TOOL_CALLS] with a JSON list; [TOOL_CALLS]name[ARGS]): the grammar
makes the model write [TOOL_CALLS] as its one token, the call is read (none of its text reaches the content), its id
is the 9 alphanumerics the template takes back, and the streamed call is the non-streamed one."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import openai
import pytest
from tokenizers import AddedToken, Tokenizer

from tests.server.harness import MODEL_NAME, ServerThread, start_tiny_server
from tests.tiny_models import build_model, save_tokenizer

_CHECK_ID = ("{% if c.id is not string or c.id | length != 9 %}"
             "{{ raise_exception('Tool call ids must be 9 alphanumerics') }}{% endif %}")
_CALLS = {  # how each template writes an assistant's calls back
    "list": ("[TOOL_CALLS] [{% for c in m.tool_calls %}" + _CHECK_ID +
             '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}, "id": "{{ c.id }}"}'
             "{% if not loop.last %}, {% endif %}{% endfor %}]</s>"),
    "args": ("{% for c in m.tool_calls %}" + _CHECK_ID +
             "[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments | tojson }}{% endfor %}</s>"),
}
_TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
             "{% if m.role == 'user' %}{% if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}"
             "[/AVAILABLE_TOOLS]{% endif %}[INST]{{ m.content }}[/INST]"
             "{% elif m.role == 'assistant' and m.tool_calls %}CALLS"
             "{% elif m.role == 'assistant' %}{{ m.content }}</s>"
             "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{% endif %}{% endfor %}")
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=sorted(_CALLS))
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    folder = tmp_path_factory.mktemp("mistral")
    save_tokenizer(folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken("[TOOL_CALLS]", special=True), AddedToken("[ARGS]", special=True)])
    tokenizer.save(str(folder / "tokenizer.json"))
    build_model("llama", vocab_size=tokenizer.get_vocab_size()).save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(_TEMPLATE.replace("CALLS", _CALLS[request.param]))
    server = start_tiny_server(folder)
    yield server
    server.stop()


def _ask(client: openai.OpenAI, **kwargs: object):
    return client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                          max_tokens=96, temperature=0, **kwargs)


def test_a_call_is_read_and_its_id_goes_back_through_the_template(server: ServerThread) -> None:
    client = server.openai_client()
    for parallel in (False, True):
        choice = _ask(client, parallel_tool_calls=parallel).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = choice.message.tool_calls
        assert len(calls) == 1 if not parallel else len(calls) >= 1
        for call in calls:
            assert re.fullmatch("[A-Za-z0-9]{9}", call.id) and call.function.name in {"get_weather", "get_time"}
            assert isinstance(json.loads(call.function.arguments), dict)
    follow_up = [*ASK, choice.message.model_dump(exclude_none=True),
                 *({"role": "tool", "tool_call_id": call.id, "content": "sunny"} for call in calls),
                 {"role": "user", "content": "And in Rome?"}]
    again = client.chat.completions.create(model=MODEL_NAME, messages=follow_up, tools=TOOLS, max_tokens=4)
    assert again.usage.prompt_tokens > _ask(client).usage.prompt_tokens


def test_the_streamed_call_is_the_non_streamed_one(server: ServerThread) -> None:
    client = server.openai_client()
    (call,) = _ask(client, parallel_tool_calls=False).choices[0].message.tool_calls
    names, arguments, finish_reasons = [], "", []
    for chunk in _ask(client, parallel_tool_calls=False, stream=True):
        choice = chunk.choices[0]
        assert not choice.delta.content
        for delta in choice.delta.tool_calls or []:
            assert delta.index == 0
            names += [delta.function.name] if delta.id is not None else []
            arguments += delta.function.arguments or ""
        finish_reasons.append(choice.finish_reason)
    assert names == [call.function.name] and arguments == call.function.arguments
    assert finish_reasons[-1] == "tool_calls"
