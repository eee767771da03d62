"""Sampling as a user sees it: seeds, n, top-k/p, logprobs, stops, min/max tokens, penalties."""

from __future__ import annotations

import pytest
import torch

from kvforge import SamplingParams
from kvforge.layers.sampler import SamplingBatch, _sample, apply_penalties, filter_probs

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


def test_penalty_arithmetic():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    batch = SamplingBatch(
        temperatures=[1.0], top_ks=[-1], top_ps=[1.0], min_ps=[0.0], presence_penalties=[0.5],
        frequency_penalties=[0.25], repetition_penalties=[2.0], prompt_token_ids=[[0]],
        output_token_ids=[[1, 3, 3]], banned_token_ids=[[]], generators=[None], num_logprobs=[None],
    )
    # repetition: 2 -> 1 (prompt), -1 -> -2, 3 -> 1.5; then presence/frequency on outputs 1 (x1) and 3 (x2)
    expected = torch.tensor([[1.0, -2.0 - 0.25 - 0.5, 0.5, 1.5 - 0.5 - 0.5]])
    assert torch.allclose(apply_penalties(logits, batch), expected)


def _batch(rows: int, **overrides) -> SamplingBatch:
    fields = dict(temperatures=[1.0] * rows, top_ks=[-1] * rows, top_ps=[1.0] * rows, min_ps=[0.0] * rows,
                  presence_penalties=[0.0] * rows, frequency_penalties=[0.0] * rows,
                  repetition_penalties=[1.0] * rows, prompt_token_ids=[[]] * rows, output_token_ids=[[]] * rows,
                  banned_token_ids=[[]] * rows, generators=[None] * rows, num_logprobs=[None] * rows)
    return SamplingBatch(**{**fields, **overrides})


def test_filters_match_a_full_sort():
    torch.manual_seed(0)
    peaked = torch.softmax(torch.randn(2, 5000) * 4, dim=-1)
    flat = torch.softmax(torch.randn(2, 5000) * 0.01, dim=-1)  # top_p needs far more than the candidates
    probs = torch.cat([peaked, flat])
    top_ks, top_ps, min_ps = [5, -1, -1, 3000], [1.0, 0.8, 0.9, 0.5], [0.0, 0.0, 0.0, 0.0]
    got = filter_probs(probs, _batch(4, top_ks=top_ks, top_ps=top_ps, min_ps=min_ps))
    values, order = probs.sort(dim=-1, descending=True)
    for row in range(4):
        keep = (values[row].cumsum(0) - values[row]) < top_ps[row]
        if top_ks[row] > 0:
            keep &= torch.arange(5000) < top_ks[row]
        expected = torch.zeros(5000).scatter(0, order[row], values[row] * keep)
        assert torch.equal(got[row], expected)
    min_p = filter_probs(probs[:1], _batch(1, min_ps=[0.1]))
    assert torch.equal(min_p > 0, probs[:1] >= 0.1 * probs[:1].max())


def test_sampling_follows_the_distribution():
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2]]).repeat(20000, 1)
    tokens = _sample(probs, [None] * 20000)
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    assert freq[1] == 0 and torch.allclose(freq, probs[0], atol=0.015)


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
