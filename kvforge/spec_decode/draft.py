"""A smaller model with the same tokenizer drafts the tokens, run by an engine of its own (its own paged KV
cache and prefix cache)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch

from kvforge.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SpeculativeConfig
from kvforge.layers.sampler import Sampler, SamplingBatch
from kvforge.sampling_params import SamplingParams
from kvforge.spec_decode.proposer import Drafts

DRAFT_KV_CACHE_MEMORY = 256 * 2**20


def draft_engine_config(target: EngineConfig) -> EngineConfig:
    """The draft's engine: the target's device and compilation, one rank, no speculation of its own; its model
    is --speculative-model, or by default the target's model file kept GGUF-quantized."""
    spec = target.speculative
    if spec.speculative_model is not None:
        model = ModelConfig(model=spec.speculative_model)
    else:
        model = ModelConfig(model=target.model.model, quantization="gguf")
    return EngineConfig(
        model=dataclasses.replace(model, max_model_len=target.model.max_model_len),
        cache=CacheConfig(block_size=target.cache.block_size, kv_cache_memory=DRAFT_KV_CACHE_MEMORY),
        parallel=ParallelConfig(), device=target.device, compilation=target.compilation,
        speculative=SpeculativeConfig(), seed=target.seed)


class _RecordingSampler(Sampler):
    """The draft engine's sampler, keeping the normalized distribution of every sampled (non-greedy) row."""

    def __init__(self) -> None:
        self.probs: list[torch.Tensor] = []  # each [rows, vocab]

    def distributions(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        greedy_ids, probs = Sampler.distributions(logits, batch)
        if probs is not None:
            self.probs.append(probs / probs.sum(-1, keepdim=True))
        return greedy_ids, probs


def draft_params(params: SamplingParams | None, num_tokens: int, max_num_tokens: int) -> SamplingParams:
    """How the draft samples for a request: greedy for greedy requests, else with the request's temperature,
    top-k, top-p and min-p, and for a seeded request a seed of its own per position (so its drafts repeat,
    drawn independently of the target's own draws).

    NOTE: penalties are left out (the draft sees the request's output as its prompt); any draft distribution
    keeps verification exact, the transforms only make drafts likelier to be accepted."""
    if params is None or params.temperature == 0.0:
        return SamplingParams(temperature=0.0, max_tokens=max_num_tokens, ignore_eos=True)
    seed = None if params.seed is None else hash((params.seed, num_tokens)) % 2**63  # ints: the same in every process
    return SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                          min_p=params.min_p, seed=seed, max_tokens=max_num_tokens, ignore_eos=True)


class DraftModelProposer:
    """Generates up to max_num_tokens draft tokens after the request's tokens, sampled as draft_params says:
    greedy requests get the draft's argmax (one-hot for the rejection sampler), sampling requests tokens drawn
    from the draft's distribution, which comes with them. The draft engine's prefix cache keeps each
    request's earlier full blocks, so a proposal recomputes only the tokens after the last cached block."""

    def __init__(self, target: EngineConfig, target_vocab_size: int) -> None:
        from kvforge.engine.llm_engine import LLMEngine

        self.engine = LLMEngine(draft_engine_config(target))
        if self.engine.vocab_size != target_vocab_size:
            raise ValueError(f"the draft model's vocabulary ({self.engine.vocab_size} tokens) is not the "
                             f"target's ({target_vocab_size})")
        self.sampler = self.engine.runner.sampler = _RecordingSampler()
        self._ids = itertools.count()

    def propose(self, request_id: str, token_ids: Sequence[int], max_num_tokens: int,
                sampling_params: SamplingParams | None = None) -> Drafts:
        engine = self.engine
        if len(token_ids) + max_num_tokens > engine.max_model_len:
            return Drafts([])
        params = draft_params(sampling_params, len(token_ids), max_num_tokens)
        draft_id = engine.add_request(f"draft-{next(self._ids)}", {"prompt_token_ids": list(token_ids)}, params)
        self.sampler.probs.clear()
        outputs = []
        while engine.has_unfinished_requests():
            outputs = engine.step() or outputs
        finished = [o for o in outputs if o.request_id == draft_id]
        drafted = list(finished[0].outputs[0].token_ids) if finished else []
        if not drafted or params.temperature == 0.0:
            return Drafts(drafted)
        # NOTE: the draft engine runs one request at a time: one sampled row per step, one step per draft
        probs = torch.cat(self.sampler.probs)[: len(drafted)]
        return Drafts(drafted, probs.float().cpu().numpy())

    def finish(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Nothing to forget: each proposal is a request of its own in the draft engine."""

    def reset(self) -> None:
        """Drop the draft engine's cached prompt blocks."""
        self.engine.reset_caches()

    def shutdown(self) -> None:
        """Release the draft engine: its model, KV cache and compiled graphs."""
        self.engine.shutdown()
