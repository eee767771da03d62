"""Verification of draft tokens: the longest accepted prefix plus one token from the target, exactly.

A request with k draft tokens has k + 1 rows of target logits: row j is the target's distribution after the
request's tokens and drafts 0..j-1; rows 0..k-1 verify the drafts, row k gives the bonus token:

    query tokens   last   d0    d1    d2          (k = 3 drafts, scheduled as extra query tokens)
    logit rows     p0     p1    p2    p3          p_j: target distribution at the position of d_j
    verifies       d0     d1    d2    (bonus)

Greedy rows accept d_j while it is the argmax of p_j and then emit the argmax of the first row that did not
accept. Sampling rows follow speculative sampling (Leviathan et al. 2023; Chen et al. 2023): accept d_j with
probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection emit a token drawn from norm(max(0, p_j - q_j));
if all k are accepted, emit a token drawn from p_k. Proposers without probabilities count as one-hot q. Every
row's p is the sampler's distribution after all the request's transforms, so each emitted token has exactly
the distribution sampling without speculation would give it.

Each request draws k + 1 uniform numbers per step (k acceptance tests, one final draw), from its own generator
when seeded: a request without drafts draws exactly what the plain sampler draws.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.layers.sampler import Sampler, SamplingBatch, draw_uniforms, invert_cdf


@dataclass(slots=True)
class DraftBatch:
    """The drafts of one step: num_draft_tokens[i] drafts for request i, their ids concatenated, and
    optionally the proposer's probabilities [sum(num_draft_tokens), vocab] (None: one-hot drafts)."""

    num_draft_tokens: list[int]
    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None = None


@dataclass(slots=True)
class Verified:
    """Per request, the tokens to append (accepted drafts, then one token of the target); emitted_rows: the
    logit row of each emitted token, concatenated in request order (for logprobs)."""

    token_ids: list[list[int]]
    emitted_rows: torch.Tensor
    emitted_token_ids: torch.Tensor


def _layout(drafts: DraftBatch, device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row bookkeeping: first row of each request [reqs]; per row [rows]: its request, its position in the
    request, its draft token (-1 on bonus rows)."""
    counts = torch.tensor(drafts.num_draft_tokens, device=device) + 1
    starts = torch.cumsum(counts, 0) - counts
    request_of_row = torch.repeat_interleave(torch.arange(len(counts), device=device), counts)
    position = torch.arange(int(counts.sum()), device=device) - starts[request_of_row]
    draft_of_row = torch.full_like(position, -1)
    is_draft = position < counts[request_of_row] - 1
    draft_of_row[is_draft] = torch.tensor(drafts.draft_token_ids, dtype=torch.long, device=device)
    return starts, request_of_row, position, draft_of_row


def _accepted(greedy: torch.Tensor, probs: torch.Tensor | None, temperatures: torch.Tensor,
              draft_of_row: torch.Tensor, q_of_draft: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row: does it accept its draft token? (False on bonus rows.)"""
    is_draft = draft_of_row >= 0
    safe_draft = draft_of_row.clamp(min=0)
    accept = greedy == safe_draft
    if probs is not None:
        p_of_draft = probs.gather(1, safe_draft[:, None])[:, 0] / probs.sum(-1)
        accept = torch.where(temperatures == 0.0, accept, uniform * q_of_draft < p_of_draft)
    return accept & is_draft


def _final_tokens(greedy: torch.Tensor, probs: torch.Tensor | None, temperatures: torch.Tensor,
                  final_rows: torch.Tensor, rejected: torch.Tensor, draft_of_row: torch.Tensor,
                  drafts: DraftBatch, draft_index: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The one token each request takes from the target at its first non-accepting row."""
    tokens = greedy[final_rows]
    if probs is None:
        return tokens
    p = probs[final_rows]
    p = p / p.sum(-1, keepdim=True)
    if drafts.draft_probs is not None:
        q = drafts.draft_probs[draft_index[final_rows].clamp(min=0)].to(p.dtype)
    else:
        q = torch.zeros_like(p).scatter_(1, draft_of_row[final_rows].clamp(min=0)[:, None], 1.0)
    residual = (p - q).clamp_(min=0.0)
    # NOTE: where p == q a rejection has probability 0; rounding can still produce one: draw from p then
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    sampled = invert_cdf(torch.where(rejected[:, None], residual, p), uniform)
    return torch.where(temperatures[final_rows] == 0.0, tokens, sampled)


def rejection_sample(logits: torch.Tensor, batch: SamplingBatch, drafts: DraftBatch,
                     generators: list[torch.Generator | None]) -> Verified:
    """logits [sum(k_i + 1), vocab]: the target's rows of every request (see the module docstring); batch:
    the sampling settings of each row (penalties and bans as of that row's position); generators: one per
    request. Vectorised over all rows: no Python loop per token."""
    device = logits.device
    starts, request_of_row, position, draft_of_row = _layout(drafts, device)
    greedy, probs = Sampler.distributions(logits, batch)
    temperatures = torch.tensor(batch.temperatures, device=device)
    num_rows, num_requests = logits.shape[0], len(drafts.num_draft_tokens)
    uniform = draw_uniforms([k + 1 for k in drafts.num_draft_tokens], generators, device, batch.generator)
    is_draft = draft_of_row >= 0
    draft_index = torch.cumsum(is_draft.long(), 0) - 1  # row -> index into draft_token_ids / draft_probs
    q_of_draft = torch.ones(num_rows, device=device)
    if drafts.draft_probs is not None and is_draft.any():
        q_rows = drafts.draft_probs[draft_index[is_draft]]
        q_of_draft[is_draft] = q_rows.gather(1, draft_of_row[is_draft][:, None])[:, 0].float()
    # uniform layout per request: k acceptance tests (on rows 0..k-1), then the final draw (on row k)
    accept = _accepted(greedy, probs, temperatures, draft_of_row, q_of_draft, uniform)
    rejected_row = (~accept).long()
    # the first non-accepting row of each request: accepted drafts = rows before it
    first_stop = torch.full((num_requests,), num_rows, device=device, dtype=torch.long)
    row_ids = torch.arange(num_rows, device=device)
    first_stop.scatter_reduce_(0, request_of_row, torch.where(rejected_row > 0, row_ids, num_rows), "amin")
    num_accepted = first_stop - starts
    final_uniform = uniform[starts + torch.tensor(drafts.num_draft_tokens, device=device)]
    final = _final_tokens(greedy, probs, temperatures, first_stop, is_draft[first_stop], draft_of_row,
                          drafts, draft_index, final_uniform)
    emitted = position <= num_accepted[request_of_row]
    emitted_rows = row_ids[emitted]
    emitted_tokens = torch.where(is_draft, draft_of_row, 0)
    emitted_tokens[first_stop] = final
    emitted_tokens = emitted_tokens[emitted]
    flat, counts = emitted_tokens.tolist(), (num_accepted + 1).tolist()
    token_ids, start = [], 0
    for count in counts:
        token_ids.append(flat[start : start + count])
        start += count
    return Verified(token_ids, emitted_rows, emitted_tokens)
