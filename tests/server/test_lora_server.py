"""LoRA adapters over HTTP with the official client: the model field picks the adapter (answers equal PEFT's),
/v1/models lists them, adapters load and unload at run time behind the API key, an unloaded adapter's new requests
get 404 while running requests finish unchanged, and /metrics counts each adapter."""

from __future__ import annotations

import threading

import openai
import pytest

from tests.lora.adapters import greedy, peft_model, save_adapter
from tests.server.harness import API_KEY, MODEL_NAME, start_tiny_server

PROMPT = [5, 9, 17, 33, 65, 129, 200, 7]
NUM_NEW = 48  # long enough that both streams still run when b is unloaded
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir, tmp_path_factory):
    """(server, {name: folder}, {name: PEFT's greedy tokens after PROMPT}) with adapters a and b loaded at run time."""
    folders = {name: save_adapter(tiny_model_dir, tmp_path_factory.mktemp(name), rank, targets, seed=seed)
               for name, rank, targets, seed in [("a", 4, ["q_proj", "v_proj", "down_proj"], 1),
                                                 ("b", 8, ["k_proj", "o_proj", "gate_proj", "up_proj"], 2)]}
    answers = {name: greedy(peft_model(tiny_model_dir, folder), PROMPT, NUM_NEW)
             for name, folder in {**folders, MODEL_NAME: None}.items()}
    server = start_tiny_server(tiny_model_dir, enable_lora=True, max_loras=2, max_lora_rank=8, kv_cache_dtype="float32",
                               lora_dtype="float32")
    for name, folder in folders.items():
        response = server.http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder)},
                                    headers=AUTH)
        assert response.status_code == 200, response.text
    yield server, folders, answers
    server.stop()


# the answer's token ids, as logprobs name them with return_tokens_as_token_ids ("token_id:N")
AS_IDS = {"ignore_eos": True, "return_tokens_as_token_ids": True}


def _ids(tokens: list[str]) -> list[int]:
    return [int(token.removeprefix("token_id:")) for token in tokens]


def _complete(client: openai.OpenAI, model: str) -> list[int]:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=NUM_NEW, temperature=0.0, logprobs=0,
                                    extra_body=AS_IDS)
    return _ids(out.choices[0].logprobs.tokens)


def test_the_model_field_picks_the_adapter(lora_server) -> None:
    server, _, answers = lora_server
    client = server.openai_client()
    assert answers["a"] != answers[MODEL_NAME] != answers["b"]
    for name in ("a", "b", MODEL_NAME):
        assert _complete(client, name) == answers[name]
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {MODEL_NAME, "a", "b"}
    assert models["a"].model_extra["parent"] == MODEL_NAME and models[MODEL_NAME].model_extra["parent"] is None
    with pytest.raises(openai.NotFoundError, match="'c' does not exist"):
        _complete(client, "c")
    metrics = server.http.get("/metrics").text
    assert 'kvforge:lora_request_success_total{finished_reason="length",lora_name="a"} 1.0' in metrics


def test_load_and_unload_need_the_key_and_name_what_is_wrong(lora_server, tmp_path) -> None:
    server, folders, _ = lora_server
    http = server.http
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 401
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)}, headers=AUTH)
    assert response.status_code == 400 and "has no adapter_config.json" in response.json()["error"]["message"]
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(folders["b"])},
                         headers=AUTH)
    assert response.status_code == 400 and "already served" in response.json()["error"]["message"]
    response = http.post("/v1/unload_lora_adapter", json={"lora_name": "nope"}, headers=AUTH)
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def test_unloading_spares_running_requests(lora_server) -> None:
    """b is unloaded while a request of a and one of b stream: both finish with PEFT's tokens; b's next request
    gets 404, and b loaded again answers as before."""
    server, folders, answers = lora_server
    client = server.openai_client()
    results: dict[str, list[int]] = {}
    started = {name: threading.Event() for name in ("a", "b")}

    def stream(name: str) -> None:
        chunks = client.completions.create(model=name, prompt=PROMPT, max_tokens=NUM_NEW, temperature=0.0,
                                           logprobs=0, stream=True, extra_body=AS_IDS)
        tokens = []
        for chunk in chunks:
            started[name].set()
            tokens += chunk.choices[0].logprobs.tokens if chunk.choices[0].logprobs else []
        results[name] = _ids(tokens)

    threads = [threading.Thread(target=stream, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    assert all(event.wait(60) for event in started.values())
    assert server.http.post("/v1/unload_lora_adapter", json={"lora_name": "b"}, headers=AUTH).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "b")
    for thread in threads:
        thread.join(60)
    assert results == {"a": answers["a"], "b": answers["b"]}
    response = server.http.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(folders["b"])},
                                headers=AUTH)
    assert response.status_code == 200
    assert _complete(client, "b") == answers["b"]


def test_serve_names_a_bad_lora_module_before_loading(capsys, tiny_model_dir) -> None:
    from kvforge.cli import main

    assert main(["serve", str(tiny_model_dir), "--lora-modules", "no-path"]) == 2
    assert "--lora-modules takes name=path, got 'no-path'" in capsys.readouterr().err
    bad = ["serve", str(tiny_model_dir), "--enforce-eager", "--kv-cache-memory", "16MiB", "--lora-modules",
           f"x={tiny_model_dir}"]
    assert main(bad) == 2  # a folder without adapter_config.json: read at start, refused
    assert "LoRA adapter 'x'" in capsys.readouterr().err
