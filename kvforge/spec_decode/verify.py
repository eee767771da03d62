"""The runner's side of verification: one sampling row per draft position, then the rejection sampler."""

from __future__ import annotations

import dataclasses

import torch

from kvforge.layers.sampler import RawLogprobs, SamplingBatch, compute_logprobs
from kvforge.spec_decode.rejection_sampler import DraftBatch, rejection_sample


def expand_rows(batch: SamplingBatch, drafts: list[list[int]], min_tokens: list[int]) -> SamplingBatch:
    """A batch of one row per request -> one row per logit row of a verification step: request i's row j
    sits after its drafts 0..j-1, so penalties count them as output and stop tokens stay banned while its
    output (with them) is shorter than min_tokens."""
    counts = [len(d) + 1 for d in drafts]
    fields = {}
    for field in dataclasses.fields(SamplingBatch):
        values = getattr(batch, field.name)
        if isinstance(values, list):
            fields[field.name] = [v for v, count in zip(values, counts) for _ in range(count)]
        elif isinstance(values, torch.Tensor):  # the grammar bitmask [rows, words] (constrained requests: no drafts)
            fields[field.name] = values.repeat_interleave(torch.tensor(counts, device=values.device), dim=0)
        else:  # the engine's generator
            fields[field.name] = values
    fields["output_token_ids"] = [out + d[:j] for out, d in zip(batch.output_token_ids, drafts)
                                  for j in range(len(d) + 1)]
    fields["banned_token_ids"] = [banned if len(out) + j < least else []
                                  for out, banned, d, least in zip(batch.output_token_ids, batch.banned_token_ids,
                                                                   drafts, min_tokens)
                                  for j in range(len(d) + 1)]
    return SamplingBatch(**fields)


def stack_draft_probs(drafts: list[list[int]], probs: list[torch.Tensor | None], vocab_size: int,
                      device: torch.device) -> torch.Tensor | None:
    """Every draft's distribution [sum(len(d)), vocab] float32 on the device (one-hot rows for greedy drafts and
    proposers without one), or None when no request has any: the rejection sampler then counts every draft as
    one-hot. The draft model's distributions are on the device already."""
    if all(p is None for p in probs):
        return None
    rows = []
    for tokens, request_probs in zip(drafts, probs):
        if request_probs is None:
            index = torch.tensor(tokens, device=device)[:, None]
            request_probs = torch.zeros((len(tokens), vocab_size), device=device).scatter_(1, index, 1.0)
        rows.append(torch.as_tensor(request_probs, dtype=torch.float32, device=device))
    return torch.cat(rows)


def verify_drafts(logits: torch.Tensor, batch: SamplingBatch, drafts: list[list[int]],
                  draft_probs: list[torch.Tensor | None], min_tokens: list[int]
                  ) -> tuple[list[list[int]], list[list[RawLogprobs]] | None]:
    """logits [sum(len(d) + 1), vocab] of each request's rows; batch: one row per request; draft_probs: per
    request, its drafts' distributions [len(d), vocab] or None (one-hot). Returns each request's tokens to
    append and, when any request asks for them, the logprobs of each appended token."""
    rows = expand_rows(batch, drafts, min_tokens)
    draft_batch = DraftBatch([len(d) for d in drafts], [t for d in drafts for t in d],
                             stack_draft_probs(drafts, draft_probs, logits.shape[-1], logits.device))
    verified = rejection_sample(logits, rows, draft_batch, batch.generators)
    if all(k is None for k in batch.num_logprobs):
        return verified.token_ids, None
    num_logprobs = [k for k, tokens in zip(batch.num_logprobs, verified.token_ids) for _ in tokens]
    flat = compute_logprobs(logits[verified.emitted_rows], verified.emitted_token_ids, num_logprobs)
    logprobs, start = [], 0
    for tokens in verified.token_ids:
        logprobs.append(flat[start : start + len(tokens)])
        start += len(tokens)
    return verified.token_ids, logprobs
