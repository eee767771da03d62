"""GPT-OSS's own chat template (the copy llama.cpp keeps among its model templates) through the server and the official
`openai` client, on a tiny model scripted to reply with an analysis message (tests/scripted_model.py): the template is
read as harmony, a required call comes after the analysis, and the call and its result go back into the next prompt as
transformers renders that conversation: the analysis before the call (the reply's reasoning_content, which the template
reads as thinking) and the call's arguments as an object (as Hugging Face's templates take them, not the API's JSON
text quoted once more)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from transformers import AutoTokenizer

from kvforge.reasoning.harmony import SPECIAL_TOKENS
from tests.loader.test_gguf_families import LLAMA_CPP
from tests.scripted_model import save_scripted_model
from tests.server.harness import MODEL_NAME, ServerThread, start_tiny_server

TEMPLATE = None if LLAMA_CPP is None else LLAMA_CPP / "models" / "templates" / "openai-gpt-oss-120b.jinja"
pytestmark = pytest.mark.skipif(TEMPLATE is None or not TEMPLATE.is_file(),
                                reason="no llama.cpp checkout with its model templates (set LLAMA_CPP_DIR)")
REASONING = "The quick fox"
ASK = [{"role": "user", "content": "The weather in Paris?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Berlin"]}},
        "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"The {name[4:]} in a city",
                                           "parameters": CITY}} for name in ("get_weather", "get_time")]  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, Path]]:
    folder: Path = tmp_path_factory.mktemp("gpt_oss_template")
    save_scripted_model(folder, f"<|channel|>analysis<|message|>{REASONING}<|end|>", special_tokens=SPECIAL_TOKENS,
                        chat_template=TEMPLATE.read_text(), generation_prompt="<|start|>assistant")
    running = start_tiny_server(folder, dtype="float32")
    yield running, folder
    running.stop()


def test_a_call_and_its_result_go_back_as_transformers_renders_them(server) -> None:
    running, folder = server
    client = running.openai_client()
    choice = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, temperature=0, max_tokens=96).choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == REASONING
    assert call.function.name in {"get_weather", "get_time"} and choice.message.content is None
    jsonschema.validate(json.loads(call.function.arguments), CITY)
    conversation = [*ASK, choice.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=conversation, tools=TOOLS, temperature=0,
                                           max_tokens=16, extra_body={"prompt_logprobs": 0})  # fmt: skip
    ours = [None if position is None else int(next(iter(position))) for position in reply.prompt_logprobs]
    # transformers, given the conversation as its chat templates take it: the call's arguments an object
    conversation[1]["tool_calls"][0]["function"]["arguments"] = json.loads(call.function.arguments)
    reference = AutoTokenizer.from_pretrained(folder)
    text = reference.apply_chat_template(conversation, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant to=functions." in text
    theirs = reference(text, add_special_tokens=False)["input_ids"]
    assert reply.usage.prompt_tokens == len(theirs) and ours[1:] == theirs[1:]
    assert reply.choices[0].message.reasoning_content == REASONING
