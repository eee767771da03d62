"""A smaller model with the same tokenizer drafts the tokens, run by an engine of its own (its own paged KV
cache and prefix cache)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from kvforge.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SpeculativeConfig
from kvforge.sampling_params import SamplingParams

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


class DraftModelProposer:
    """Drafts greedily (the draft's argmax: a one-hot draft distribution for the rejection sampler) by
    generating up to max_num_tokens tokens after the request's tokens. The draft engine's prefix cache keeps
    each request's earlier full blocks, so a proposal recomputes only the tokens after the last cached block."""

    def __init__(self, target: EngineConfig, target_vocab_size: int) -> None:
        from kvforge.engine.llm_engine import LLMEngine

        self.engine = LLMEngine(draft_engine_config(target))
        if self.engine.vocab_size != target_vocab_size:
            raise ValueError(f"the draft model's vocabulary ({self.engine.vocab_size} tokens) is not the "
                             f"target's ({target_vocab_size})")
        self._ids = itertools.count()

    def propose(self, request_id: str, token_ids: Sequence[int], max_num_tokens: int) -> list[int]:
        engine = self.engine
        if len(token_ids) + max_num_tokens > engine.max_model_len:
            return []
        params = SamplingParams(temperature=0.0, max_tokens=max_num_tokens, ignore_eos=True)
        draft_id = engine.add_request(f"draft-{next(self._ids)}", {"prompt_token_ids": list(token_ids)}, params)
        outputs = []
        while engine.has_unfinished_requests():
            outputs = engine.step() or outputs
        finished = [o for o in outputs if o.request_id == draft_id]
        return list(finished[0].outputs[0].token_ids) if finished else []

    def finish(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Nothing to forget: each proposal is a request of its own in the draft engine."""
