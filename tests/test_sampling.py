"""Sampling as a user sees it: seeds, n, top-k/p, logprobs, stops, min/max tokens, penalties."""

from __future__ import annotations

import pytest
import torch

from kvforge import SamplingParams

PROMPTS = [{"prompt_token_ids": [5, 9, 23, 42, 7]}, {"prompt_token_ids": list(range(10, 40))}]


def _tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = tiny_llm.generate(PROMPTS[:1], params)
    together = tiny_llm.generate(PROMPTS + PROMPTS, [params, SamplingParams(temperature=0.7, max_tokens=20)] * 2)
    assert _tokens(alone)[0] == _tokens(together)[0] == _tokens(together)[2]
    other_seed = tiny_llm.generate(PROMPTS[:1], SamplingParams(temperature=1.0, seed=99, max_tokens=12,
                                                                ignore_eos=True))
    assert _tokens(other_seed) != _tokens(alone)


def test_an_engine_samples_from_its_own_generator_and_leaves_torchs_alone(tiny_llm, tiny_llama_dir):
    """Building a second engine and sampling with it leave torch's global random state as it was; the requests
    without a seed draw from the engine's generator (seeded with its `seed`), so a new engine of the same seed
    samples the same tokens, whatever torch's global generator did before, and seeded requests repeat."""
    from kvforge import LLM

    unseeded, seeded = (SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=seed)
                        for seed in (None, 1234))
    state = torch.get_rng_state()
    engines = [LLM(str(tiny_llama_dir[0]), kv_cache_memory="4MiB", enforce_eager=True, seed=3) for _ in range(2)]
    first = _tokens(engines[0].generate(PROMPTS, unseeded))
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(99)  # moves torch's global generator, which no engine reads
    assert _tokens(engines[1].generate(PROMPTS, unseeded)) == first
    assert _tokens(engines[0].generate(PROMPTS, unseeded)) != first  # its generator went on
    assert _tokens(engines[1].generate(PROMPTS, seeded)) == _tokens(tiny_llm.generate(PROMPTS, seeded))


def test_n_samples_differ_and_reproduce(tiny_llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    first, again = tiny_llm.generate(PROMPTS[:1], params)[0], tiny_llm.generate(PROMPTS[:1], params)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in first.outputs}) == 3
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]


def test_top_k_1_and_tiny_top_p_equal_greedy(tiny_llm):
    greedy = tiny_llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    top_k = tiny_llm.generate(PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True))
    top_p = tiny_llm.generate(PROMPTS, SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=10,
                                                      ignore_eos=True))
    assert _tokens(greedy) == _tokens(top_k) == _tokens(top_p)


def test_logprobs_match_transformers(tiny_llm, tiny_llama_dir):
    model = tiny_llama_dir[1]
    prompt = PROMPTS[1]["prompt_token_ids"]
    out = tiny_llm.generate([{"prompt_token_ids": prompt}],
                            SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3,
                                           prompt_logprobs=2))[0]
    tokens = out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0].float(), dim=-1)
    for step, (token, position) in enumerate(zip(tokens, out.outputs[0].logprobs)):
        row = ref[len(prompt) - 1 + step]
        assert len(position) == 3 and position[token].rank == 1  # greedy token is in the top 3
        top3 = row.topk(3).indices.tolist()
        assert list(position) == top3
        for token_id, logprob in position.items():
            assert logprob.logprob == pytest.approx(row[token_id].item(), abs=1e-4)
    prompt_logprobs = out.prompt_logprobs
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        entry = prompt_logprobs[i][prompt[i]]
        assert entry.logprob == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)
        assert entry.rank == int((ref[i - 1] > ref[i - 1, prompt[i]]).sum()) + 1
        assert len(prompt_logprobs[i]) in (2, 3)  # top 2, plus the actual token when outside them
    scored = tiny_llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    assert scored.outputs[0].token_ids == [] and scored.outputs[0].finish_reason == "length"  # the prompt alone
    assert scored.prompt_logprobs[0] is None
    for ours, earlier in zip(scored.prompt_logprobs[1:], prompt_logprobs[1:], strict=True):
        expected = {t: lp.logprob for t, lp in earlier.items()}
        assert {t: lp.logprob for t, lp in ours.items()} == pytest.approx(expected, abs=1e-5)


def test_stop_strings_cut_the_text_across_tokens(tiny_llm):
    base = tiny_llm.generate("Paris is the", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    text = base.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop.strip()) > 0
    out = tiny_llm.generate("Paris is the", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                           stop=[stop]))[0].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_stop_token_ids_min_tokens_and_max_tokens(tiny_llm):
    greedy = tiny_llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    tokens = greedy[0].outputs[0].token_ids
    stop_id = tokens[2]
    out = tiny_llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id]))
    completion = out[0].outputs[0]
    assert completion.token_ids == tokens[: tokens.index(stop_id) + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_id
    held = tiny_llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=6,
                                                         stop_token_ids=[stop_id]))[0].outputs[0]
    assert stop_id not in held.token_ids[:6] and len(held.token_ids) >= 6
    assert greedy[0].outputs[0].finish_reason == "length" and len(tokens) == 12


def test_repetition_penalty_stops_repeats(tiny_llm):
    prompt = PROMPTS[1]["prompt_token_ids"]
    out = tiny_llm.generate([{"prompt_token_ids": prompt}],
                            SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                           repetition_penalty=1e6))[0].outputs[0].token_ids
    assert len(set(out)) == len(out) and not set(out) & set(prompt)


def test_streamed_text_never_shows_what_a_stop_string_removes(tiny_llm):
    engine = tiny_llm.engine
    base = tiny_llm.generate("Paris is the", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
    text = base.outputs[0].text
    stop = text[4:9]
    engine.add_request("held", "Paris is the", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                                stop=[stop]))
    shown = []
    while engine.has_unfinished_requests():
        shown += [o.outputs[0].text for o in engine.step()]
    final = shown[-1]
    assert final == text[: text.index(stop)]
    assert all(final.startswith(partial) for partial in shown)
