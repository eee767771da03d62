"""From logits to the next token of every request: grammar masks, logit bias, penalties, temperature,
top-k/top-p/min-p, seeds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.kernels.cpu.argmax import argmax_rows

# (token_id, logprob, rank) for the top-k tokens of one position, the actual token first.
RawLogprobs = list[tuple[int, float, int]]


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling settings for one step, built by the model runner. Row i is one request."""

    temperatures: list[float]
    top_ks: list[int]
    top_ps: list[float]
    min_ps: list[float]
    presence_penalties: list[float]
    frequency_penalties: list[float]
    repetition_penalties: list[float]
    # read by penalties and draft verification only: the runner lists them only for such batches (else empty lists)
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    banned_token_ids: list[list[int]]  # EOS and stop ids while min_tokens is not reached
    generators: list[torch.Generator | None]
    num_logprobs: list[int | None]
    # [rows, ceil(vocab / 32)] int32 on the device: bit j of word k allows token 32 k + j (None: no row
    # is constrained; an unconstrained row is all ones)
    allowed_token_bitmask: torch.Tensor | None = None
    logit_biases: list[dict[int, float] | None] | None = None
    generator: torch.Generator | None = None  # the engine's: rows without a generator of their own draw from it
    # (None: torch's default generator, for batches made by hand)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf for every token whose bit is clear: logits [rows, vocab], bitmask [rows, words] int32."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().flatten(1)  # [rows, words * 32]
    vocab = logits.shape[-1]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    return logits.masked_fill(~allowed[:, :vocab], float("-inf"))


def apply_logit_bias(logits: torch.Tensor, biases: list[dict[int, float] | None]) -> torch.Tensor:
    """Add each row's {token id: bias} to its logits (one scatter for the whole batch)."""
    rows = [row for row, bias in enumerate(biases) if bias for _ in bias]
    token_ids = [token_id for bias in biases if bias for token_id in bias]
    values = [value for bias in biases if bias for value in bias.values()]
    index = (torch.tensor(rows, device=logits.device), torch.tensor(token_ids, device=logits.device))
    return logits.index_put(index, torch.tensor(values, device=logits.device, dtype=logits.dtype),
                            accumulate=True)


def _token_counts(token_lists: list[list[int]], shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    counts = torch.zeros(shape, dtype=torch.float32, device=device)
    for row, tokens in enumerate(token_lists):
        if tokens:
            ids = torch.tensor(tokens, device=device)
            counts[row].index_add_(0, ids, torch.ones(len(tokens), dtype=torch.float32, device=device))
    return counts


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition penalty over prompt and output tokens; presence and frequency over output tokens."""
    device = logits.device
    if any(p != 1.0 for p in batch.repetition_penalties):
        seen = _token_counts(
            [p + o for p, o in zip(batch.prompt_token_ids, batch.output_token_ids)], logits.shape, device
        ) > 0
        penalty = torch.tensor(batch.repetition_penalties, dtype=torch.float32, device=device)[:, None]
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)  # penalty broadcast over the vocabulary
        logits = torch.where(seen, scaled, logits)
    if any(batch.presence_penalties) or any(batch.frequency_penalties):
        counts = _token_counts(batch.output_token_ids, logits.shape, device)
        frequency = torch.tensor(batch.frequency_penalties, dtype=torch.float32, device=device)[:, None]
        presence = torch.tensor(batch.presence_penalties, dtype=torch.float32, device=device)[:, None]
        logits = logits - frequency * counts - presence * (counts > 0).float()
    return logits


# top-k / top-p look among this many most likely tokens first; a row whose candidates hold less
# than its top_p mass falls back to the whole vocabulary.
_CANDIDATES = 1024


def _sorted_keep(values: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """values: [rows, k] probabilities sorted descending -> which of them survive top-k and top-p."""
    device = values.device
    k = values.shape[-1]
    keep = torch.ones_like(values, dtype=torch.bool)
    if any(t > 0 for t in top_k):
        limit = torch.tensor([t if t > 0 else k for t in top_k], device=device)
        keep &= torch.arange(k, device=device)[None, :] < limit[:, None]
    if any(p < 1.0 for p in top_p):
        mass_before = values.cumsum(dim=-1) - values  # keep a token while the mass before it is < top_p
        keep &= mass_before < torch.tensor(top_p, dtype=torch.float32, device=device)[:, None]
    return keep


def filter_probs(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Zero the probabilities outside top-k, top-p and min-p (not renormalized).

    Sorting the whole vocabulary is the slow part on a CPU, so top-k/top-p take the top candidates
    with topk() and widen to the full vocabulary only for rows that need it."""
    vocab = probs.shape[-1]
    mask = None
    if any(k > 0 for k in batch.top_ks) or any(p < 1.0 for p in batch.top_ps):
        num = min(vocab, max([_CANDIDATES] + [k for k in batch.top_ks if k > 0]))
        values, indices = probs.topk(num, dim=-1)
        if num < vocab:
            short = (values.sum(dim=-1) < torch.tensor(batch.top_ps, dtype=torch.float32, device=probs.device)).tolist()
            if any(short):
                values, indices = probs.sort(dim=-1, descending=True)
        keep = _sorted_keep(values, batch.top_ks, batch.top_ps)
        mask = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, indices, keep)
    if any(p > 0.0 for p in batch.min_ps):
        min_p = torch.tensor(batch.min_ps, dtype=torch.float32, device=probs.device)[:, None]
        above = probs >= min_p * probs.amax(dim=-1, keepdim=True)
        mask = above if mask is None else mask & above
    return probs if mask is None else probs * mask


def draw_uniforms(counts: list[int], generators: list[torch.Generator | None], device: torch.device,
                  default: torch.Generator | None = None) -> torch.Tensor:
    """counts[i] uniform numbers for row i, concatenated: rows with their own generator draw theirs from it,
    so a seeded request gives the same tokens whatever else is in the batch; the others from default (the engine's
    generator)."""
    uniform = torch.rand(sum(counts), dtype=torch.float32, device=device, generator=default)
    start = 0
    for count, generator in zip(counts, generators):
        if generator is not None and count:
            uniform[start : start + count] = torch.rand(count, dtype=torch.float32, generator=generator, device=device)
        start += count
    return uniform


def invert_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """probs [rows, vocab] (not necessarily normalized), uniform [rows] -> one token per row."""
    cdf = probs.cumsum(dim=-1)
    token_ids = torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:], right=True)
    return token_ids.squeeze(1).clamp_(max=probs.shape[-1] - 1)


def _sample(probs: torch.Tensor, generators: list[torch.Generator | None],
            default: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row by inverting its CDF at one uniform number (see draw_uniforms)."""
    return invert_cdf(probs, draw_uniforms([1] * probs.shape[0], generators, probs.device, default))


def _gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: list[int | None]
) -> list[RawLogprobs | None]:
    """For each row: the actual token's (id, logprob, rank), then the top-k tokens'."""
    max_k = max(k for k in num_logprobs if k is not None)
    actual = logprobs.gather(-1, token_ids[:, None])  # [rows, 1]
    ranks = (logprobs > actual).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(max(max_k, 1), dim=-1)
    actual_l, ranks_l, ids_l = actual[:, 0].tolist(), ranks.tolist(), token_ids.tolist()
    top_values_l, top_ids_l = top_values.tolist(), top_ids.tolist()
    result: list[RawLogprobs | None] = []
    for row, k in enumerate(num_logprobs):
        if k is None:
            result.append(None)
            continue
        entries = [(ids_l[row], actual_l[row], ranks_l[row])]
        entries += [(t, v, r + 1) for r, (t, v) in enumerate(zip(top_ids_l[row][:k], top_values_l[row][:k]))]
        result.append(entries)
    return result


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: list[int | None]
) -> list[RawLogprobs | None]:
    """Logprobs of the model's own distribution (before penalties and temperature), as vLLM reports."""
    return _gather_logprobs(torch.log_softmax(logits.float(), dim=-1), token_ids, num_logprobs)


class Sampler:
    """Samples one token per row. Greedy rows (temperature 0) take the argmax after penalties."""

    @staticmethod
    def distributions(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every transform a row asks for, applied to logits [rows, vocab]: the greedy ids [rows] (argmax
        after the grammar's mask, biases, bans and penalties) and, unless every row is greedy, the
        probabilities [rows, vocab] to draw from (after temperature, top-k/top-p/min-p; not renormalized)."""
        raw_logits = logits
        if batch.allowed_token_bitmask is not None:  # first: every later transform sees only allowed tokens
            logits = apply_token_bitmask(logits, batch.allowed_token_bitmask)
        if batch.logit_biases is not None:
            logits = apply_logit_bias(logits, batch.logit_biases)
        for row, banned in enumerate(batch.banned_token_ids):
            if banned:
                logits = logits.clone() if logits is raw_logits else logits
                logits[row, banned] = float("-inf")
        logits = apply_penalties(logits, batch)
        greedy_ids = argmax_rows(logits)  # the first of equal maxima; the C++ kernel on the CPU
        if all(t == 0.0 for t in batch.temperatures):
            return greedy_ids, None
        temperatures = torch.tensor(batch.temperatures, dtype=torch.float32, device=logits.device)
        scaled = logits / temperatures.clamp_min(1e-5)[:, None]
        return greedy_ids, filter_probs(torch.softmax(scaled, dim=-1), batch)

    def __call__(
        self, logits: torch.Tensor, batch: SamplingBatch
    ) -> tuple[list[int], list[RawLogprobs | None] | None]:
        greedy_ids, probs = self.distributions(logits, batch)  # logits: [num_rows, vocab] fp32
        token_ids = greedy_ids
        if probs is not None:
            temperatures = torch.tensor(batch.temperatures, dtype=torch.float32, device=logits.device)
            token_ids = torch.where(temperatures == 0.0, greedy_ids, _sample(probs, batch.generators, batch.generator))
        logprobs = None
        if any(k is not None for k in batch.num_logprobs):
            logprobs = compute_logprobs(logits, token_ids, batch.num_logprobs)
        return token_ids.tolist(), logprobs
