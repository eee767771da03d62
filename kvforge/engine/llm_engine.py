"""The engine loop: add requests, step the scheduler and model, turn tokens into outputs."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque

import torch
from torch import nn

from kvforge.config import EngineConfig
from kvforge.engine.kv_cache_manager import KVCacheManager
from kvforge.engine.prompts import PromptType, tokenize_prompt
from kvforge.engine.request import Request, RequestStatus
from kvforge.engine.sample_group import SampleGroup, logprob_decoder
from kvforge.engine.scheduler import Scheduler, StepResult
from kvforge.engine.speculation import Speculation
from kvforge.engine.stats import CacheStats, EngineStats
from kvforge.executor.executor import create_executor
from kvforge.executor.model_runner import ModelRunner
from kvforge.kernels.cpu.extension import kernels_build
from kvforge.loader.heap import release_freed_memory
from kvforge.lora.request import LoRARequest
from kvforge.outputs import RequestOutput
from kvforge.sampling_params import SamplingParams
from kvforge.spec_decode.policy import SpeculationPolicy, StepCosts
from kvforge.step_data import ModelRunnerOutput, NewRequest, ScheduledRequest, SchedulerOutput
from kvforge.structured_output.compiler import GrammarCompiler

logger = logging.getLogger(__name__)


def _speculation(config: EngineConfig, buckets: tuple[int, ...]) -> Speculation | None:
    """buckets: the row counts the runner pads decode steps to (its compiled batch sizes). The runner proposes the
    drafts (spec_decode/proposer.py; the draft model: executor/draft_runner.py)."""
    spec = config.speculative
    if spec.speculative_method is None:
        return None
    policy = SpeculationPolicy(spec.num_speculative_tokens, spec.speculative_max_rows, StepCosts(buckets),
                               spec.speculative_adaptive)
    # NOTE: the draft model writes the keys and values of its own drafts past the request's step (lookahead)
    lookahead = spec.num_speculative_tokens if spec.speculative_method == "draft" else 0
    return Speculation(policy, lookahead)


class LLMEngine:
    """Owns the tokenizer, scheduler, KV cache manager and executor, and steps them together.

    `add_request` queues a prompt; each `step` runs one batch and returns the outputs of the requests
    that advanced; `abort_request` drops requests and frees their blocks at once. The scheduler applies
    each step's tokens to its requests; the engine turns them into text, logprobs and outputs.
    `shutdown` (or dropping the last reference) releases the model, its KV cache and everything else it holds.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.is_shut_down = True  # NOTE: until the engine is whole: an __init__ that fails leaves __del__ nothing to do
        self.config = config
        self.executor = create_executor(config)
        try:
            info = self.executor.model_info
            self.device = info.device
            self.attention_backend = info.attention_backend
            self.tokenizer = info.tokenizer
            self.model_name = info.name
            self.hf_config = info.hf_config
            self.vocab_size = info.vocab_size
            num_blocks, block_size = self.executor.num_blocks, config.cache.block_size
            self.kv_cache_manager = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching,
                                                   info.layer_groups, config.scheduler.max_num_batched_tokens,
                                                   config.cache.num_state_checkpoints)
            graphs = self.runner.decode_graphs
            speculation = _speculation(config, () if graphs is None else graphs.buckets)
            max_loras = config.lora.max_loras if config.lora.enable_lora else None
            # NOTE: a hybrid model's state slots may run fewer requests than max_num_seqs (Worker.kv_cache_size)
            scheduling = dataclasses.replace(config.scheduler, max_num_seqs=self.executor.kv_cache_size.max_num_seqs)
            self.scheduler = Scheduler(scheduling, self.kv_cache_manager, speculation, max_loras)
            self.in_flight: deque[SchedulerOutput] = deque()
            self.max_model_len = min(info.max_model_len, self.kv_cache_manager.capacity_tokens)
            self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
            self.groups: dict[str, SampleGroup] = {}
            self._ids = itertools.count()
            self._decode_logprobs = logprob_decoder(self.tokenizer)
            # NOTE: thread-safe; the async engine awaits compilations on its event loop, off the step loop
            self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
        except BaseException:
            # NOTE: the compiles begun at start (--compile-at-start) hold the model on their thread: stopped at once
            self.executor.shutdown()
            raise
        self.is_shut_down = False
        self._log_cache(info.kv_cache_dtype, info.kv_bytes_per_token)

    def _log_cache(self, dtype: torch.dtype, bytes_per_token: int) -> None:
        logger.info("attention backend: %s", self.attention_backend)
        if torch.device(self.device).type == "cpu":
            logger.info("CPU kernels: %s", kernels_build().describe())
        kv_dtype = str(dtype).removeprefix("torch.")
        size, block_size = self.executor.kv_cache_size, self.config.cache.block_size
        logger.info("KV cache (%s, %d bytes/token): %d blocks of %d tokens = %d tokens (%.1f MiB per rank), set by "
                    "%s; max model len %d", kv_dtype, bytes_per_token, size.num_blocks - 1, block_size,
                    self.kv_cache_manager.capacity_tokens, size.num_blocks * block_size * bytes_per_token / 2**20,
                    size.limit, self.max_model_len)

    @property
    def runner(self) -> ModelRunner:
        """This process's model runner, for instrumentation that wraps its methods (the profiler)."""
        return self.executor.worker.runner

    @property
    def local_model(self) -> nn.Module:
        """This process's share of the model (the whole model on one device), for tools and tests that
        read its weights. Generation never needs it."""
        self._check_running()
        return self.executor.local_model

    def kv_cache_bytes(self) -> int:
        """Bytes of this process's KV cache tensors."""
        return self.executor.kv_cache_bytes()

    def cache_stats(self) -> CacheStats:
        return self.kv_cache_manager.stats()

    def stats(self) -> EngineStats:
        """Queues and KV cache counters now (the server's metrics and the async engine read these)."""
        return EngineStats.of(self.scheduler.stats(), self.kv_cache_manager.stats())

    def reset_caches(self) -> None:
        """Forget what finished requests left behind: the prefix cache's free blocks and, with speculation, the
        proposer's memory of them (the suffix trie of finished requests: the runner's proposer forgets it before the
        next step). Running requests are not touched."""
        self._check_running()
        self.kv_cache_manager.reset_prefix_cache()
        if self.scheduler.speculation is not None:
            self.scheduler.speculation.reset()

    def num_compiling(self) -> int:
        """Decode buckets queued or compiling in the background; any thread may ask (0 once shut down)."""
        runner = self.executor.worker.runner  # NOTE: read once: None from the moment a shutdown releases it
        graphs = None if runner is None else runner.decode_graphs
        return 0 if graphs is None else graphs.num_compiling

    def shutdown(self) -> None:
        """Stop the compiles in the background and release the model, its KV cache and compiled graphs, the grammar
        threads, a draft model and the other ranks' processes (if any). The engine cannot be used afterwards
        (RuntimeError); a second call does nothing."""
        if self.is_shut_down:
            return
        self.is_shut_down = True
        self.grammars.shutdown()
        self.executor.shutdown()
        self.groups.clear()
        self.in_flight.clear()
        # NOTE: glibc keeps the freed heap memory of the model's smaller tensors and objects (measured, four
        # default-model engines made and dropped in turn: RSS 180-320 MiB above where the first began after each
        # drop, 120-140 MiB with this)
        release_freed_memory()

    def __del__(self) -> None:
        self.shutdown()

    def _check_running(self) -> None:
        if self.is_shut_down:
            raise RuntimeError("the engine has been shut down (shutdown(), close() or the end of its with block) and "
                               "holds no model: make a new one")

    # ---- requests in ------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, self.vocab_size, prompt)

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams,
                    lora_request: LoRARequest | None = None) -> str:
        """Queue a prompt (text, token ids or a dict with either), run with a LoRA adapter or the base model (None);
        returns its request id. A bad adapter is a ValueError naming it."""
        self._check_running()
        if lora_request is not None:
            self.add_lora(lora_request)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, but this engine fits at most "
                f"{self.max_model_len - 1} prompt tokens (max model len {self.max_model_len})"
            )
        vocab_size = self.vocab_size
        if any(t >= vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be below the vocabulary size {vocab_size}: {params.stop_token_ids}")
        if params.logit_bias and max(params.logit_bias) >= vocab_size:
            raise ValueError(f"logit_bias token ids must be below the vocabulary size {vocab_size}: "
                             f"{sorted(t for t in params.logit_bias if t >= vocab_size)}")
        # NOTE: waits for the grammar when it is still compiling; callers on a step loop compile first
        grammar = None if params.structured_output is None else self.grammars.compile(params.structured_output).result()
        group = SampleGroup.create(request_id, text, token_ids, params, self.tokenizer, self.eos_token_ids,
                                   self.max_model_len, lora_request)
        self.groups[request_id] = group
        starts_after = None if params.structured_output is None else params.structured_output.starts_after
        for request in group.requests:
            request.grammar = None if grammar is None else grammar.matcher(starts_after)
            self.scheduler.add_request(request)
        return request_id

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check a LoRA adapter now (requests that name it later find it ready); a bad adapter, or an
        engine without enable_lora, is a ValueError naming it."""
        self._check_running()
        self.executor.load_lora(lora_request)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Drop requests at once; their KV blocks are free when this returns."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            group = self.groups.pop(request_id, None)
            if group is not None:
                ids = [r.request_id for r in group.requests if not r.status.finished]
                self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def score(self, token_ids: list[int], lora_request: LoRARequest | None = None) -> torch.Tensor:
        """The model's fp32 logits after each token of token_ids (with a LoRA adapter, if given): [len(token_ids),
        vocab].

        Runs between steps in blocks of its own, freed before returning (no prefix-cache reuse)."""
        self._check_running()
        if lora_request is not None:
            self.add_lora(lora_request)
        _, token_ids = self.tokenize_prompt(token_ids)
        if not 0 < len(token_ids) <= self.max_model_len:
            raise ValueError(f"can score 1 to {self.max_model_len} tokens, got {len(token_ids)}")
        request = Request(f"score-{next(self._ids)}", token_ids, SamplingParams(max_tokens=1), lora=lora_request)
        if not self.kv_cache_manager.allocate_slots(request, len(token_ids)):
            raise ValueError("not enough free KV cache blocks to score this sequence now")
        try:
            request_id = request.request_id
            new = NewRequest(request_id, token_ids, len(token_ids), request.sampling_params, lora_request)
            scheduled = ScheduledRequest(request_id, token_ids, 0, self.kv_cache_manager.get_block_tables(request_id),
                                         len(token_ids), False, [])
            if self.in_flight:
                raise ValueError("cannot score while steps are in flight; call step() until they finish")
            return self.executor.score(SchedulerOutput(scheduled=[scheduled], new_requests=[new]))
        finally:
            self.kv_cache_manager.free(request)

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule one batch, run it, and return outputs for every request that advanced.

        With pipeline parallelism, up to pp_size batches of different requests are submitted before
        the oldest is collected, so every stage has work; a step returns the oldest batch's outputs."""
        self._check_running()
        start = time.perf_counter()
        while len(self.in_flight) < self.executor.max_in_flight:
            busy = {s.request_id for out in self.in_flight for s in out.scheduled}
            scheduler_output = self.scheduler.schedule(busy, self.executor.max_in_flight)
            scheduler_output.grammar_bitmask = self.scheduler.grammar_bitmask(scheduler_output,
                                                                              self.grammars.bitmask_words)
            if self.in_flight and not scheduler_output.scheduled and not scheduler_output.finished_request_ids:
                break
            self.executor.submit(scheduler_output)
            self.in_flight.append(scheduler_output)
            if not scheduler_output.scheduled:
                break
        scheduler_output = self.in_flight.popleft()
        runner_output = self.executor.collect()
        result = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.executor.max_in_flight == 1 and not runner_output.warmup:  # a step's own time, as it runs now
            self.scheduler.record_step_time(scheduler_output, time.perf_counter() - start)
        outputs = []
        for group in self._record(result, runner_output):
            if group.finished:
                del self.groups[group.request_id]
            outputs.append(group.to_output())
        while self.in_flight and not self.groups:  # only finished or aborted work is left in flight
            self.in_flight.popleft()
            self.executor.collect()
        return outputs

    def _record(self, result: StepResult, out: ModelRunnerOutput) -> list[SampleGroup]:
        """Detokenize and keep the logprobs of what the step appended; finish samples whose text now
        holds a stop string. Returns the groups that advanced, in batch order."""
        advanced: dict[str, SampleGroup] = {}
        for request in result.advanced:
            group = self.groups.get(request.group_id)
            if group is None:
                continue
            advanced[group.request_id] = group
            sample, request_id = group.samples[request.sample_index], request.request_id
            if request_id in out.prompt_logprobs:
                start, chunk = out.prompt_logprobs[request_id]
                sample.add_prompt_logprobs(start, chunk, self._decode_logprobs)
            new_token_ids = result.new_token_ids.get(request_id)
            if not new_token_ids:
                continue
            if sample.logprobs is not None:
                sample.logprobs.extend(self._decode_logprobs(out.logprobs[request_id][: len(new_token_ids)]))
            stop_string = sample.add_tokens(new_token_ids)
            if stop_string is not None and not request.status.finished:
                self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_STOPPED, stop_string)
        return list(advanced.values())
