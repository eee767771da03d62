"""The engine of a pooling model: inputs in, one embedding, class probabilities or score out per input."""

from __future__ import annotations

import itertools

import torch

from kvforge.config import EngineConfig
from kvforge.engine.pooling_scheduler import PoolingRequest, PoolingScheduler
from kvforge.engine.prompts import PromptType, tokenize_prompt
from kvforge.engine.stats import CacheStats, EngineStats
from kvforge.executor.pooling_executor import PoolingExecutor
from kvforge.loader.heap import release_freed_memory
from kvforge.outputs import PoolingOutput, PoolingRequestOutput
from kvforge.pooling_params import PoolingParams

# A pooling engine keeps no KV cache: its cache counters are all zero.
_NO_CACHE = CacheStats(num_free_blocks=0, num_usable_blocks=0, block_size=1, num_prefix_query_tokens=0,
                       num_prefix_hit_tokens=0)


class PoolingEngine:
    """Owns the tokenizer, the pooling scheduler and the pooling model's executor (runner "pooling").

    `add_request` checks and queues an input; each `step` runs the oldest inputs that fit one batch and returns
    their finished outputs; `abort_request` drops waiting inputs. Nothing outlives a request: no KV cache is kept.
    The same driving interface as LLMEngine, so AsyncEngine (and the server) serve either."""

    def __init__(self, config: EngineConfig) -> None:
        self.is_shut_down = True  # NOTE: until the engine is whole (see LLMEngine)
        self.config = config
        self.executor = PoolingExecutor(config)
        loaded = self.executor.loaded
        model_config = loaded.model.config
        self.device = self.executor.device
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.hf_config = loaded.hf_config
        self.vocab_size = model_config.vocab_size
        self.hidden_size = model_config.hidden_size
        self.pooler = loaded.pooler
        self.has_classifier = self.executor.runner.classifier is not None
        # how many token types the model reads (0: it reads none, and a prompt's token_type_ids are ignored)
        self.num_token_types = model_config.type_vocab_size if loaded.model.takes_token_types else 0
        windows = (config.model.max_model_len, model_config.max_position, self.pooler.max_seq_length)
        self.max_model_len = min(w for w in windows if w is not None)
        self.scheduler = PoolingScheduler(config.scheduler)
        self.prompts: dict[str, list[int]] = {}
        self._ids = itertools.count()
        self.is_shut_down = False

    @property
    def local_model(self) -> torch.nn.Module:
        self._check_running()
        return self.executor.model

    def reset_caches(self) -> None:
        """Nothing to forget: a pooling engine caches nothing between requests."""
        self._check_running()

    def stats(self) -> EngineStats:
        return EngineStats.of(self.scheduler.stats(), _NO_CACHE)

    def shutdown(self) -> None:
        """Release the model; the engine cannot be used afterwards (RuntimeError). A second call does nothing."""
        if self.is_shut_down:
            return
        self.is_shut_down = True
        self.executor.shutdown()
        self.scheduler.waiting.clear()
        self.prompts.clear()
        release_freed_memory()

    def __del__(self) -> None:
        self.shutdown()

    def _check_running(self) -> None:
        if self.is_shut_down:
            raise RuntimeError("the engine has been shut down (shutdown(), close() or the end of its with block) and "
                               "holds no model: make a new one")

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, self.vocab_size, prompt)

    def _token_type_ids(self, prompt: PromptType, num_tokens: int) -> list[int] | None:
        """A prompt dict's token_type_ids (a cross-encoder pair's), checked, where the model reads them."""
        token_type_ids = prompt.get("token_type_ids") if isinstance(prompt, dict) else None
        if token_type_ids is None or not self.num_token_types:
            return None
        token_type_ids = list(token_type_ids)
        if len(token_type_ids) != num_tokens:
            raise ValueError(f"token_type_ids has {len(token_type_ids)} values for {num_tokens} tokens")
        if not all(isinstance(t, int) and 0 <= t < self.num_token_types for t in token_type_ids):
            raise ValueError(f"token_type_ids must be integers in [0, {self.num_token_types})")
        return token_type_ids

    def input_token_ids(self, prompt: PromptType, params: PoolingParams) -> tuple[list[int], list[int] | None]:
        """The input's token ids and token types (None: all of type 0); ValueError naming the window when the input
        does not fit the model's. params.truncate_prompt_tokens = k keeps the input's last k tokens (-1: as many as
        the window holds), its special tokens included, as vLLM does."""
        _, token_ids = self.tokenize_prompt(prompt)
        if not token_ids:
            raise ValueError("the input is empty")
        token_type_ids = self._token_type_ids(prompt, len(token_ids))
        truncate = params.truncate_prompt_tokens
        if truncate is not None:
            if truncate > self.max_model_len:
                raise ValueError(f"truncate_prompt_tokens={truncate} is more than this model's window of "
                                 f"{self.max_model_len} tokens")
            keep = self.max_model_len if truncate == -1 else truncate
            token_ids = token_ids[-keep:]
            token_type_ids = None if token_type_ids is None else token_type_ids[-keep:]
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"the input has {len(token_ids)} tokens, but this model's window is "
                             f"{self.max_model_len} tokens; shorten it, or set truncate_prompt_tokens to keep its "
                             f"last tokens")
        return token_ids, token_type_ids

    def check_params(self, params: PoolingParams) -> None:
        if not isinstance(params, PoolingParams):
            raise ValueError("this model runs with runner 'pooling': it embeds, classifies and scores (LLM.embed, "
                             "LLM.classify, LLM.score; /v1/embeddings, /classify, /score, /rerank) and does not "
                             "generate text")
        if params.dimensions is not None and params.dimensions > self.hidden_size:
            raise ValueError(f"dimensions must be at most the model's {self.hidden_size}, got {params.dimensions}")
        if params.task != "embed" and not self.has_classifier:
            raise ValueError(f"this model has no classifier head: it embeds, and cannot {params.task}")

    def add_request(self, request_id: str | None, prompt: PromptType, params: PoolingParams) -> str:
        """Queue an input (text, token ids or a dict with either); returns its request id."""
        self._check_running()
        self.check_params(params)
        request_id = request_id if request_id is not None else str(next(self._ids))
        token_ids, token_type_ids = self.input_token_ids(prompt, params)
        self.scheduler.add_request(PoolingRequest(request_id, token_ids, params, token_type_ids))
        self.prompts[request_id] = token_ids
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.scheduler.abort_request(request_id)
            self.prompts.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[PoolingRequestOutput]:
        """Run the next batch of inputs; their outputs, finished."""
        self._check_running()
        step = self.scheduler.schedule()
        if not step.request_ids:
            return []
        results = self.executor.execute(step)
        return [PoolingRequestOutput(request_id, self.prompts.pop(request_id), PoolingOutput(data))
                for request_id, data in zip(step.request_ids, results, strict=True)]
