"""A smaller model with the same tokenizer drafts the tokens (run by the model runner, executor/draft_runner.py):
which model it is, and how it samples a request's drafts and the distributions they come from."""

from __future__ import annotations

import dataclasses

import torch

from kvforge.config import EngineConfig, ModelConfig
from kvforge.layers.sampler import Sampler, SamplingBatch, invert_cdf
from kvforge.sampling_params import SamplingParams


def draft_model_config(target: EngineConfig) -> ModelConfig:
    """The draft's model: --speculative-model, or by default the target's model file kept GGUF-quantized; in the
    target's dtype and length limit."""
    spec = target.speculative
    if spec.speculative_model is not None:
        model = ModelConfig(model=spec.speculative_model, dtype=target.model.dtype)
    else:
        model = ModelConfig(model=target.model.model, quantization="gguf")
    return dataclasses.replace(model, max_model_len=target.model.max_model_len)


def draft_params(params: SamplingParams | None, num_tokens: int, max_num_tokens: int) -> SamplingParams:
    """How the draft samples for a request: greedy for greedy requests, else with the request's temperature,
    top-k, top-p and min-p, and for a seeded request a seed of its own per proposal (so its drafts repeat,
    drawn independently of the target's own draws).

    NOTE: penalties are left out (the draft sees the request's output as its prompt); any draft distribution
    keeps verification exact, the transforms only make drafts likelier to be accepted."""
    if params is None or params.temperature == 0.0:
        return SamplingParams(temperature=0.0, max_tokens=max_num_tokens, ignore_eos=True)
    seed = None if params.seed is None else hash((params.seed, num_tokens)) % 2**63  # ints: the same in every process
    return SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                          min_p=params.min_p, seed=seed, max_tokens=max_num_tokens, ignore_eos=True)


def draft_generators(params: list[SamplingParams], device: torch.device) -> list[torch.Generator | None]:
    """A generator per request whose draft_params carry a seed (None: the draws come from the runner's)."""
    return [None if p.seed is None else torch.Generator(device).manual_seed(p.seed) for p in params]


def draft_sampling_batch(params: list[SamplingParams], generators: list[torch.Generator | None],
                         default: torch.Generator) -> SamplingBatch:
    """One row per request, sampling as its draft_params say (no penalties, bans nor logprobs)."""
    num_rows = len(params)
    empty: list[list[int]] = [[] for _ in range(num_rows)]
    return SamplingBatch(
        temperatures=[p.temperature for p in params], top_ks=[p.top_k for p in params],
        top_ps=[p.top_p for p in params], min_ps=[p.min_p for p in params],
        presence_penalties=[0.0] * num_rows, frequency_penalties=[0.0] * num_rows,
        repetition_penalties=[1.0] * num_rows, prompt_token_ids=empty, output_token_ids=empty,
        banned_token_ids=empty, generators=generators, num_logprobs=[None] * num_rows, generator=default)


def draft_distributions(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [rows, vocab] -> the greedy ids [rows] and, unless every row is greedy, the normalized distributions
    [rows, vocab] the sampled rows draw from (after every transform of the row): what the rejection sampler
    takes as q."""
    greedy_ids, probs = Sampler.distributions(logits, batch)
    if probs is None:
        return greedy_ids, None
    return greedy_ids, probs / probs.sum(-1, keepdim=True)


def sample_drafts(logits: torch.Tensor, batch: SamplingBatch, uniform: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft per row: greedy rows take the argmax, the others a token drawn from their distribution at
    uniform [rows]. Returns the tokens [rows] and the distributions [rows, vocab] (None: every row greedy; the
    greedy rows' are not read: their drafts count as one-hot)."""
    greedy_ids, probs = draft_distributions(logits, batch)
    if probs is None:
        return greedy_ids, None
    temperatures = torch.tensor(batch.temperatures, dtype=torch.float32, device=logits.device)
    return torch.where(temperatures == 0.0, greedy_ids, invert_cdf(probs, uniform)), probs
