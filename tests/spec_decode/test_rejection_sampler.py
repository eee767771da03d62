"""The rejection sampler is exact: with speculation, the first sampled tokens have the distribution that
sampling without speculation gives them, whatever the drafts; a wrong acceptance rule is caught."""

from __future__ import annotations

import pytest
import torch

from kvforge.layers.sampler import Sampler, SamplingBatch
from kvforge.spec_decode import rejection_sampler
from kvforge.spec_decode.rejection_sampler import DraftBatch, rejection_sample

VOCAB = 6
NUM_TRIALS = 6000


def _batch(rows: int, temperature: float = 1.0, top_k: int = -1, generators=None,
           output_token_ids=None) -> SamplingBatch:
    return SamplingBatch(
        temperatures=[temperature] * rows, top_ks=[top_k] * rows, top_ps=[1.0] * rows, min_ps=[0.0] * rows,
        presence_penalties=[0.0] * rows, frequency_penalties=[0.0] * rows, repetition_penalties=[1.0] * rows,
        prompt_token_ids=[[]] * rows, output_token_ids=output_token_ids or [[]] * rows,
        banned_token_ids=[[]] * rows, generators=generators or [None] * rows, num_logprobs=[None] * rows)


def _tables() -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token logits given the previous token, of a target and of a deliberately different draft."""
    gen = torch.Generator().manual_seed(1)
    return torch.randn(VOCAB, VOCAB, generator=gen) * 1.5, torch.randn(VOCAB, VOCAB, generator=gen) * 1.5


def _target_probs(target: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """What the sampler draws from without speculation: [prev, next]."""
    _, probs = Sampler.distributions(target, _batch(VOCAB, temperature, top_k))
    return probs / probs.sum(-1, keepdim=True)


def _speculate_two_tokens(target, draft, k: int, temperature: float, top_k: int, with_probs: bool
                          ) -> torch.Tensor:
    """NUM_TRIALS sequences from token 0, speculating k drafts per step until each has two new tokens."""
    torch.manual_seed(0)
    draft_probs = torch.softmax(draft, dim=-1)
    sequences = [[0] for _ in range(NUM_TRIALS)]
    while pending := [s for s in sequences if len(s) < 3]:
        drafts, probs_rows, logit_rows = [], [], []
        for seq in pending:
            prev, proposed = seq[-1], []
            for _ in range(k):  # the draft samples (with_probs) or proposes its argmax (one-hot)
                q = draft_probs[prev]
                token = int(torch.multinomial(q, 1)) if with_probs else int(q.argmax())
                proposed.append(token)
                probs_rows.append(q)
                prev = token
            drafts.append(proposed)
            logit_rows += [target[t] for t in [seq[-1]] + proposed]
        batch = DraftBatch([k] * len(pending), [t for d in drafts for t in d],
                           torch.stack(probs_rows) if with_probs else None)
        verified = rejection_sample(torch.stack(logit_rows), _batch(len(logit_rows), temperature, top_k),
                                    batch, [None] * len(pending))
        for seq, tokens in zip(pending, verified.token_ids):
            seq.extend(tokens)
    return torch.tensor([s[1:3] for s in sequences])


def _chi_square_p_value(pairs: torch.Tensor, expected: torch.Tensor) -> float:
    counts = torch.bincount(pairs[:, 0] * VOCAB + pairs[:, 1], minlength=VOCAB * VOCAB).double()
    expected = expected.flatten().double() * len(pairs)
    cells = expected > 0
    assert counts[~cells].sum() == 0, "a token outside the target's support was emitted"
    statistic = ((counts[cells] - expected[cells]) ** 2 / expected[cells]).sum()
    dof = torch.tensor(float(cells.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))  # the chi-square survival function


def _joint(target_probs: torch.Tensor) -> torch.Tensor:
    """P(first new token, second new token) starting from token 0, without speculation."""
    return target_probs[0][:, None] * target_probs


@pytest.mark.parametrize("with_probs", [True, False], ids=["draft-probs", "one-hot"])
@pytest.mark.parametrize("temperature, top_k", [(1.0, -1), (0.7, 4)])
def test_first_tokens_follow_the_target_distribution(with_probs, temperature, top_k):
    target, draft = _tables()
    pairs = _speculate_two_tokens(target, draft, 3, temperature, top_k, with_probs)
    assert _chi_square_p_value(pairs, _joint(_target_probs(target, temperature, top_k))) > 1e-3


def _accept_whenever_likely_under_draft(greedy, probs, temperatures, draft_of_row, q_of_draft, uniform):
    """A wrong rule: accept with min(1, q / p) instead of min(1, p / q)."""
    is_draft = draft_of_row >= 0
    p = probs.gather(1, draft_of_row.clamp(min=0)[:, None])[:, 0] / probs.sum(-1)
    return (uniform * p < q_of_draft) & is_draft


def _resample_from_target(greedy, probs, temperatures, final_rows, rejected, draft_of_row, drafts,
                          draft_index, uniform):
    """A wrong rule: after a rejection draw from p instead of norm(max(0, p - q))."""
    return rejection_sampler.invert_cdf(probs[final_rows], uniform)


@pytest.mark.parametrize("name, wrong", [("_accepted", _accept_whenever_likely_under_draft),
                                         ("_final_tokens", _resample_from_target)])
def test_a_wrong_rule_fails_the_test(monkeypatch, name, wrong):
    target, draft = _tables()
    monkeypatch.setattr(rejection_sampler, name, wrong)
    pairs = _speculate_two_tokens(target, draft, 3, 1.0, -1, True)
    assert _chi_square_p_value(pairs, _joint(_target_probs(target, 1.0, -1))) < 1e-6


def test_greedy_accepts_the_prefix_matching_the_argmax_plus_one_target_token():
    logits = torch.full((7, VOCAB), -5.0)
    argmax = [3, 1, 4, 2, 5, 0, 2]  # request a: rows 0-3 (3 drafts), b: rows 4-5 (1 draft), c: row 6 (none)
    logits[torch.arange(7), argmax] = 5.0
    drafts = DraftBatch([3, 1, 0], [3, 1, 0, 5])  # a: 3, 1 match, 0 does not; b: 5 matches
    verified = rejection_sample(logits, _batch(7, temperature=0.0), drafts, [None] * 3)
    assert verified.token_ids == [[3, 1, 4], [5, 0], [2]]
    assert verified.emitted_rows.tolist() == [0, 1, 2, 4, 5, 6]


def test_greedy_rows_see_penalties_of_the_drafts_before_them():
    logits = torch.tensor([[0.0, 2.0, 1.9], [0.0, 2.0, 1.9]])
    # row 1 sits after draft token 1: a frequency penalty there makes token 2 the argmax
    batch = _batch(2, temperature=0.0, output_token_ids=[[], [1]])
    batch.frequency_penalties = [1.0, 1.0]
    verified = rejection_sample(logits, batch, DraftBatch([1], [1]), [None])
    assert verified.token_ids == [[1, 2]]


def test_seeded_requests_repeat_whatever_else_is_in_the_batch():
    target, _ = _tables()
    logits = target[[0, 1, 2, 3, 4, 5]]  # a: 2 drafts (rows 0-2), b: 2 drafts (rows 3-5)
    drafts = DraftBatch([2, 2], [1, 2, 4, 5])

    def run(other_seed: int | None) -> list[int]:
        gens = [torch.Generator().manual_seed(7),
                None if other_seed is None else torch.Generator().manual_seed(other_seed)]
        return rejection_sample(logits, _batch(6), drafts, gens).token_ids[0]

    first = [run(None) for _ in range(20)]
    assert all(tokens == first[0] for tokens in first) and first == [run(3) for _ in range(20)]


def test_without_drafts_a_seeded_request_draws_what_the_plain_sampler_draws():
    target, _ = _tables()
    for seed in range(20):
        plain, _ = Sampler()(target[:1], _batch(1, generators=[torch.Generator().manual_seed(seed)]))
        verified = rejection_sample(target[:1], _batch(1), DraftBatch([0], []), [torch.Generator().manual_seed(seed)])
        assert verified.token_ids == [plain]
