"""/v1/completions as evaluation harnesses and code editors use it, through the official client on a tiny model with
StarCoder's fill-in-the-middle tokens: max_tokens 0 with echo and logprobs scores a prompt (strings, token ids and
batches of them) as transformers does, lm-eval's local-completions model scores loglikelihoods through it unmodified,
suffix builds the fill-in-the-middle prompt, and best_of returns the most likely of its candidates."""

from __future__ import annotations

import copy
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import tokenizers
import torch

from tests.server.harness import API_KEY, MODEL_NAME, ServerThread, start_tiny_server
from tests.server.test_errors import assert_error, post

FIM_TOKENS = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]
PROMPTS = ["The quick brown fox", "Paris is the capital of"]


@pytest.fixture(scope="module")
def fim_model(tiny_llama_dir: tuple[Path, object], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """The tiny Llama with the FIM tokens added to its vocabulary and embeddings: (folder, transformers model)."""
    folder = tmp_path_factory.mktemp("fim") / "model"
    shutil.copytree(tiny_llama_dir[0], folder)
    tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens(FIM_TOKENS)
    tokenizer.save(str(folder / "tokenizer.json"))
    model = copy.deepcopy(tiny_llama_dir[1])
    model.resize_token_embeddings(tokenizer.get_vocab_size())
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def server(fim_model: tuple[Path, object]) -> Iterator[ServerThread]:
    server = start_tiny_server(fim_model[0])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return server.openai_client()


def _complete(client: openai.OpenAI, **kwargs: object):
    return client.completions.create(model=MODEL_NAME, **kwargs)


def _token_ids(server: ServerThread, text: str) -> list[int]:
    return post(server, "/tokenize", {"prompt": text}).json()["tokens"]


def _reference_logprobs(model: object, token_ids: list[int]) -> torch.Tensor:
    """transformers' log-probabilities of each next token: [len(token_ids), vocab]."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("as_token_ids", [False, True])
def test_max_tokens_0_with_echo_scores_the_prompts(client: openai.OpenAI, server: ServerThread,
                                                   fim_model: tuple[Path, object], as_token_ids: bool) -> None:
    token_ids = [_token_ids(server, text) for text in PROMPTS]
    prompts = token_ids if as_token_ids else PROMPTS
    for prompt, num_prompts in ((prompts[0], 1), (prompts, 2)):  # one prompt, and a batch
        completion = _complete(client, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0, seed=1)
        assert len(completion.choices) == num_prompts and completion.usage.completion_tokens == 0
        assert completion.usage.prompt_tokens == sum(len(ids) for ids in token_ids[:num_prompts])
        for choice, ids, text in zip(completion.choices, token_ids, PROMPTS, strict=False):
            assert choice.text == text and choice.finish_reason == "length"
            logprobs = choice.logprobs
            assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing predicts it
            assert "".join(logprobs.tokens) == text and len(logprobs.tokens) == len(ids)
            expected = _reference_logprobs(fim_model[1], ids)
            for i, token_id in enumerate(ids[1:], start=1):
                assert logprobs.token_logprobs[i] == pytest.approx(expected[i - 1, token_id].item(), abs=1e-3)
                assert max(logprobs.top_logprobs[i].values()) == pytest.approx(expected[i - 1].max().item(), abs=1e-3)


def test_max_tokens_0_without_echo_is_an_empty_completion(client: openai.OpenAI) -> None:
    for stream in (False, True):
        completion = _complete(client, prompt=PROMPTS, max_tokens=0, stream=stream,
                               stream_options={"include_usage": True} if stream else None)
        chunks = list(completion) if stream else [completion]
        assert [c.text for chunk in chunks for c in chunk.choices] == ["", ""]
        assert {c.finish_reason for chunk in chunks for c in chunk.choices} == {"length"}
        assert chunks[-1].usage.completion_tokens == 0
    streamed = _complete(client, prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=0, stream=True)
    assert "".join(c.text for chunk in streamed for c in chunk.choices) == PROMPTS[0]


def test_lm_eval_local_completions_scores_loglikelihoods(server: ServerThread, fim_model: tuple[Path, object],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from transformers import AutoTokenizer

    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    lm = LocalCompletionsAPI(base_url=f"{server.base_url}/v1/completions", model=MODEL_NAME, auth_token=API_KEY,
                             batch_size=2, max_retries=1)
    assert lm.tokenizer_backend == "remote"  # found /tokenizer_info and /tokenize
    pairs = [("The quick brown", " fox jumps"), ("Paris is the capital of", " France"), ("", "Berlin is"),
             ("def add(a, b):", "\n    return a + b")]
    results = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)],
                               disable_tqdm=True)
    hf_tokenizer = AutoTokenizer.from_pretrained(fim_model[0])
    for (context, continuation), (loglikelihood, is_greedy) in zip(pairs, results, strict=True):
        context_ids = hf_tokenizer.encode(context, add_special_tokens=False) or [hf_tokenizer.bos_token_id]
        whole = context_ids + hf_tokenizer.encode(continuation, add_special_tokens=False)
        expected = _reference_logprobs(fim_model[1], whole)
        positions = range(len(context_ids) - 1, len(whole) - 1)
        assert loglikelihood == pytest.approx(sum(expected[i, whole[i + 1]].item() for i in positions), abs=1e-3)
        assert is_greedy == all(expected[i].argmax().item() == whole[i + 1] for i in positions)


def test_suffix_builds_the_fill_in_the_middle_prompt(client: openai.OpenAI, server: ServerThread,
                                                     tiny_server: ServerThread) -> None:
    prefix, suffix = "def add(a, b):\n    return", "\n\nprint(add(1, 2))"
    filled = _complete(client, prompt=prefix, suffix=suffix, max_tokens=6, temperature=0)
    fim_prompt = f"<fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle>"  # StarCoder's format
    plain = _complete(client, prompt=fim_prompt, max_tokens=6, temperature=0)
    assert filled.choices[0].text == plain.choices[0].text
    assert filled.usage.prompt_tokens == plain.usage.prompt_tokens == len(_token_ids(server, fim_prompt))
    body = {"model": MODEL_NAME, "prompt": prefix, "suffix": suffix, "max_tokens": 2}
    assert_error(post(server, "/v1/completions", {**body, "echo": True}), 400, "suffix")
    assert_error(post(server, "/v1/completions", {**body, "prompt": [5, 6]}), 400, "suffix")
    refused = assert_error(post(tiny_server, "/v1/completions", body), 400, "suffix")  # no FIM tokens
    assert "fill-in-the-middle tokens" in refused["message"]


def test_best_of_returns_the_most_likely_candidates(client: openai.OpenAI, server: ServerThread) -> None:
    kwargs = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 1.0, "seed": 11}
    candidates = _complete(client, n=5, logprobs=0, **kwargs)
    ranked = sorted(candidates.choices, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    assert [c.index for c in ranked[:2]] != [0, 1]  # the first two generated are not the answer
    best = _complete(client, n=2, best_of=5, **kwargs)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1] and all(c.logprobs is None for c in best.choices)
    assert best.usage.completion_tokens == candidates.usage.completion_tokens  # every candidate counts
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}
    assert_error(post(server, "/v1/completions", {**body, "n": 3, "best_of": 2}), 400, "best_of")
    assert_error(post(server, "/v1/completions", {**body, "best_of": 2, "stream": True}), 400, "best_of")
