"""The sampler's arithmetic on hand-made logits: penalties, top-k/top-p/min-p filters, the draw itself."""

from __future__ import annotations

import torch

from kvforge.layers.sampler import SamplingBatch, _sample, apply_penalties, filter_probs


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
