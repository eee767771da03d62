"""Sampled drafts with their probabilities: the draft samples after the request's transforms (temperature,
top-k) and passes what it sampled from; the emitted tokens keep the target's distribution, a draft that
reports another distribution than the one it sampled from is caught, and through the engine the target as
its own draft has every sampled draft accepted (which only holds when q reaches the rejection sampler)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from kvforge import LLM, SamplingParams
from kvforge.spec_decode import draft
from kvforge.spec_decode.draft import draft_distributions, draft_params
from kvforge.spec_decode.verify import verify_drafts
from tests.spec_decode.test_rejection_sampler import (
    NUM_TRIALS,
    _batch,
    _chi_square_p_value,
    _joint,
    _tables,
    _target_probs,
)

TEMPERATURE, TOP_K = 0.6, 3


def _draft_step(reported_q: Callable, draft: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
    """One draft token per sequence after prev, sampled as the draft model samples for the request; with the q
    that reported_q(logits, distribution sampled from) makes of it."""
    params = draft_params(SamplingParams(temperature=TEMPERATURE, top_k=TOP_K), 1, 1)
    _, probs = draft_distributions(draft[prev], _batch(len(prev), params.temperature, params.top_k))
    tokens = torch.multinomial(probs, 1)[:, 0]
    return tokens, reported_q(draft[prev], probs).numpy()


def _speculate_two_tokens(reported_q: Callable, k: int = 2) -> torch.Tensor:
    """NUM_TRIALS sequences from token 0, k sampled drafts per step (through the runner's verify_drafts)
    until each has two new tokens. Half of them pass q, half pass none: a draft counted as one-hot is
    accepted with p(d) and otherwise replaced from p without d, which gives p whatever chose d."""
    torch.manual_seed(0)
    target, draft_logits = _tables()
    sequences = [[0] for _ in range(NUM_TRIALS)]
    while pending := [s for s in sequences if len(s) < 3]:
        prev = torch.tensor([s[-1] for s in pending])
        tokens, probs = [], []
        for _ in range(k):
            prev, q = _draft_step(reported_q, draft_logits, prev)
            tokens.append(prev)
            probs.append(q)
        drafts = torch.stack(tokens, 1).tolist()  # [pending, k]
        # per sequence [k, vocab]; every other sequence's drafts count as one-hot (exact too, see below)
        draft_probs = [q if i % 2 == 0 else None for i, q in enumerate(np.stack(probs, 1))]
        logits = torch.stack([target[t] for seq, d in zip(pending, drafts) for t in [seq[-1]] + d])
        batch = _batch(len(pending), TEMPERATURE, TOP_K)
        token_ids, _ = verify_drafts(logits, batch, drafts, draft_probs, [0] * len(pending))
        for seq, new in zip(pending, token_ids):
            seq.extend(new)
    return torch.tensor([s[1:3] for s in sequences])


def _untransformed_q(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """A wrong draft: samples after the transforms but reports the draft model's plain softmax as q."""
    return torch.softmax(logits, dim=-1)


def test_sampled_drafts_keep_the_target_distribution():
    pairs = _speculate_two_tokens(lambda logits, probs: probs)
    assert _chi_square_p_value(pairs, _joint(_target_probs(_tables()[0], TEMPERATURE, TOP_K))) > 1e-3


def test_a_draft_that_reports_another_q_fails_the_test():
    pairs = _speculate_two_tokens(_untransformed_q)
    assert _chi_square_p_value(pairs, _joint(_target_probs(_tables()[0], TEMPERATURE, TOP_K))) < 1e-6


def test_the_target_as_its_own_draft_accepts_every_sampled_draft(tiny_llama_dir, monkeypatch):
    folder = str(tiny_llama_dir[0])
    llm = LLM(folder, kv_cache_memory="16MiB", enforce_eager=True, speculative_method="draft",
              speculative_model=folder, num_speculative_tokens=3, speculative_adaptive=False)
    prompts = [{"prompt_token_ids": [5, 9, 17, 33]}, {"prompt_token_ids": list(range(40, 60))}]
    params = SamplingParams(temperature=0.8, top_k=8, max_tokens=12, ignore_eos=True, seed=4)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    stats = llm.engine.stats().spec_decode
    # q = p at every draft: min(1, p / q) accepts all (with one-hot q a draft would pass with p(d) < 1)
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate == pytest.approx(1.0, abs=0.02)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == first  # seeded drafts repeat
    assert all(len(tokens) == 12 for tokens in first)
    monkeypatch.setattr(draft, "draft_params", lambda *args: draft_params(None, *args[1:]))  # greedy drafts
    before = llm.engine.stats().spec_decode
    llm.generate(prompts, params)
    after = llm.engine.stats().spec_decode
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    assert accepted < 0.9 * (after.num_draft_tokens - before.num_draft_tokens)
