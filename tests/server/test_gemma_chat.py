"""Gemma's chat template through the server and the official `openai` client: Google's Gemma 2 template (the copy
llama.cpp keeps among its model templates) on a tiny model scripted to reply `Salut<end_of_turn>Paris`, with
Gemma's end markers in its generation config: the prompt is the tokens transformers renders of the template, the
reply ends at <end_of_turn>, and the messages the template refuses (a system message, roles out of turn) are 400s
naming why."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from tests.loader.test_gguf_families import LLAMA_CPP
from tests.scripted_model import save_scripted_model
from tests.server.harness import MODEL_NAME, ServerThread, start_tiny_server

TEMPLATE = None if LLAMA_CPP is None else LLAMA_CPP / "models" / "templates" / "google-gemma-2-2b-it.jinja"
pytestmark = pytest.mark.skipif(TEMPLATE is None or not TEMPLATE.is_file(),
                                reason="no llama.cpp checkout with its model templates (set LLAMA_CPP_DIR)")
TURNS = ("<start_of_turn>", "<end_of_turn>")
CONVERSATION = [{"role": "user", "content": "Say hello "}, {"role": "assistant", "content": " Hello."},
                {"role": "user", "content": "In French?"}]  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, Path]]:
    folder: Path = tmp_path_factory.mktemp("gemma_chat")
    save_scripted_model(folder, "Salut<end_of_turn>Paris", special_tokens=TURNS, chat_template=TEMPLATE.read_text(),
                        generation_prompt="<start_of_turn>model\n")  # fmt: skip
    # as Gemma's instruction-tuned checkpoints ship: generation ends at <eos> or <end_of_turn>
    tokenizer = AutoTokenizer.from_pretrained(folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    generation["eos_token_id"] = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")]
    (folder / "generation_config.json").write_text(json.dumps(generation))
    running = start_tiny_server(folder, dtype="float32")
    yield running, folder
    running.stop()


def test_the_prompt_is_the_templates_rendering(server) -> None:
    running, folder = server
    reference = AutoTokenizer.from_pretrained(folder)
    text = reference.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert text.count("<start_of_turn>model\n") == 2
    assert text.endswith("In French?<end_of_turn>\n<start_of_turn>model\n")
    response = running.http.post("/tokenize", json={"model": MODEL_NAME, "messages": CONVERSATION},
                                 headers={"Authorization": f"Bearer {running.openai_client().api_key}"})  # fmt: skip
    assert response.status_code == 200, response.text
    assert response.json()["tokens"] == reference(text, add_special_tokens=False)["input_ids"]


def test_the_reply_ends_at_the_end_of_turn(server) -> None:
    client = server[0].openai_client()
    choice = client.chat.completions.create(model=MODEL_NAME, messages=CONVERSATION, temperature=0,
                                            max_tokens=20).choices[0]  # fmt: skip
    assert (choice.message.content, choice.finish_reason) == ("Salut", "stop")


@pytest.mark.parametrize(("messages", "reason"), [
    ([{"role": "system", "content": "Be brief."}, *CONVERSATION], "System role not supported"),
    (CONVERSATION[:1] * 2, "Conversation roles must alternate"),
])  # fmt: skip
def test_messages_the_template_refuses_are_400s(server, messages, reason) -> None:
    with pytest.raises(openai.BadRequestError, match=reason) as refused:
        server[0].openai_client().chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4)
    assert refused.value.status_code == 400 and refused.value.body["type"] == "invalid_request_error"
