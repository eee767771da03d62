"""The engine loop: add requests, step the scheduler and model, turn tokens into outputs."""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from kvforge.config import EngineConfig
from kvforge.engine.detokenizer import IncrementalDetokenizer
from kvforge.engine.kv_cache_manager import KVCacheManager
from kvforge.engine.request import Request, RequestStatus
from kvforge.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from kvforge.executor.executor import create_executor
from kvforge.executor.model_runner import ModelRunner, ModelRunnerOutput
from kvforge.layers.sampler import RawLogprobs
from kvforge.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from kvforge.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict


@dataclass(slots=True, eq=False)
class _Sample:
    request: Request
    detokenizer: IncrementalDetokenizer


@dataclass(slots=True, eq=False)
class _Group:
    """A user request: one prompt, n samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample]

    @property
    def finished(self) -> bool:
        return all(s.request.status.finished for s in self.samples)


class LLMEngine:
    """Owns the tokenizer, scheduler, KV cache manager and model runner, and steps them together.

    `add_request` queues a prompt; each `step` runs one batch and returns the outputs of the requests
    that advanced; `abort_request` drops requests and frees their blocks at once.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        torch.manual_seed(config.seed)
        self.executor = create_executor(config)
        worker = self.executor.worker
        loaded = worker.loaded
        self.device = worker.device
        self.attention_backend = worker.attention_backend
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.hf_config = loaded.hf_config
        model_cfg = loaded.model.config
        self.vocab_size = model_cfg.vocab_size
        bytes_per_token = worker.bytes_per_token
        num_blocks, block_size = self.executor.num_blocks, config.cache.block_size
        self.kv_cache_manager = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager)
        self.in_flight: deque[SchedulerOutput] = deque()
        self.max_model_len = min(config.model.max_model_len or model_cfg.max_position,
                                 model_cfg.max_position, self.kv_cache_manager.capacity_tokens)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self.groups: dict[str, _Group] = {}
        self._ids = itertools.count()
        logger.info("attention backend: %s", self.attention_backend)
        kv_dtype = config.cache.kv_cache_dtype
        if kv_dtype == "auto":
            kv_dtype = str(loaded.dtype).removeprefix("torch.")
        logger.info("KV cache (%s, %d bytes/token): %d blocks of %d tokens = %d tokens (%.1f MiB per rank); "
                    "max model len %d", kv_dtype, bytes_per_token, num_blocks - 1, block_size,
                    self.kv_cache_manager.capacity_tokens, num_blocks * block_size * bytes_per_token / 2**20,
                    self.max_model_len)

    @property
    def runner(self) -> ModelRunner:
        """The model runner of this process's rank (the whole model on one device)."""
        return self.executor.worker.runner

    def shutdown(self) -> None:
        """Stop the other ranks' processes (if any). The engine cannot step afterwards."""
        self.executor.shutdown()

    # ---- requests in ------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        vocab_size = self.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
        return None, list(prompt)

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams) -> str:
        """Queue a prompt (text, token ids or a dict with either); returns its request id."""
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
        samples = []
        for index in range(params.n):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + index
                child_params = SamplingParams(**{**_fields(params), "n": 1, "seed": seed})
            request = Request(f"{request_id}#{index}", token_ids, child_params, self.eos_token_ids,
                              self.max_model_len)
            detok = IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens, params.stop,
                                           params.include_stop_str_in_output)
            samples.append(_Sample(request, detok))
        self.groups[request_id] = _Group(request_id, text, token_ids, samples)
        for sample in samples:
            self.scheduler.add_request(sample.request)
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Drop requests at once; their KV blocks are free when this returns."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            group = self.groups.pop(request_id, None)
            if group is not None:
                ids = [s.request.request_id for s in group.samples if not s.request.status.finished]
                self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """The model's fp32 logits after each token of token_ids: [len(token_ids), vocab].

        Runs between steps in blocks of its own, freed before returning (no prefix-cache reuse)."""
        _, token_ids = self.tokenize_prompt(token_ids)
        if not 0 < len(token_ids) <= self.max_model_len:
            raise ValueError(f"can score 1 to {self.max_model_len} tokens, got {len(token_ids)}")
        request = Request(f"score-{next(self._ids)}", token_ids, SamplingParams(max_tokens=1))
        if not self.kv_cache_manager.allocate_slots(request, len(token_ids)):
            raise ValueError("not enough free KV cache blocks to score this sequence now")
        try:
            scheduled = ScheduledRequest(request.request_id, token_ids, 0,
                                         self.kv_cache_manager.get_block_table(request.request_id),
                                         request.sampling_params, token_ids, [], False, [])
            if self.in_flight:
                raise ValueError("cannot score while steps are in flight; call step() until they finish")
            return self.executor.score(SchedulerOutput(scheduled=[scheduled]))
        finally:
            self.kv_cache_manager.free(request)

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule one batch, run it, and return outputs for every request that advanced.

        With pipeline parallelism, up to pp_size batches of different requests are submitted before
        the oldest is collected, so every stage has work; a step returns the oldest batch's outputs."""
        while len(self.in_flight) < self.executor.max_in_flight:
            busy = {s.request_id for out in self.in_flight for s in out.scheduled}
            scheduler_output = self.scheduler.schedule(busy, self.executor.max_in_flight)
            if self.in_flight and not scheduler_output.scheduled and not scheduler_output.finished_request_ids:
                break
            self.executor.submit(scheduler_output)
            self.in_flight.append(scheduler_output)
            if not scheduler_output.scheduled:
                break
        scheduler_output = self.in_flight.popleft()
        runner_output = self.executor.collect()
        self.scheduler.update_after_step(scheduler_output)
        touched = {s.request_id.rsplit("#", 1)[0] for s in scheduler_output.scheduled}
        self._apply(runner_output)
        outputs = []
        for group_id in touched:
            group = self.groups.get(group_id)
            if group is None:
                continue
            if group.finished:
                del self.groups[group_id]
            outputs.append(self._make_output(group))
        while self.in_flight and not self.groups:  # only finished or aborted work is left in flight
            self.in_flight.popleft()
            self.executor.collect()
        return outputs

    def _apply(self, out: ModelRunnerOutput) -> None:
        requests = self.scheduler.requests
        for request_id, (start, chunk) in out.prompt_logprobs.items():
            request = requests.get(request_id)
            if request is not None and start == len(request.prompt_logprobs):  # not a recompute after preemption
                request.prompt_logprobs.extend(self._logprob_dicts(chunk))
        finished: dict[RequestStatus, list[str]] = {}
        for request_id, token_id in out.sampled_token_ids.items():
            request = requests.get(request_id)
            if request is None:  # aborted while its step was in flight
                continue
            request.append_output_token(token_id)
            if request.logprobs is not None:
                request.logprobs.extend(self._logprob_dicts([out.logprobs[request_id]]))
            status = request.check_stop_token()
            stop_string = self._detokenizer(request_id).add_token(token_id)
            if stop_string is not None and status is None:
                request.stop_reason, status = stop_string, RequestStatus.FINISHED_STOPPED
            if status is not None:
                finished.setdefault(status, []).append(request_id)
        for status, request_ids in finished.items():
            self.scheduler.finish_requests(request_ids, status)

    def _detokenizer(self, request_id: str) -> IncrementalDetokenizer:
        group_id, index = request_id.rsplit("#", 1)
        return self.groups[group_id].samples[int(index)].detokenizer

    def _logprob_dicts(self, entries: list[RawLogprobs]) -> list[PositionLogprobs]:
        decode = self.tokenizer.decode
        return [
            {token_id: Logprob(logprob, rank, decode([token_id], skip_special_tokens=False))
             for token_id, logprob, rank in position}
            for position in entries
        ]

    def _make_output(self, group: _Group) -> RequestOutput:
        completions = []
        for index, sample in enumerate(group.samples):
            request = sample.request
            finished = request.status.finished
            completions.append(CompletionOutput(
                index=index,
                text=sample.detokenizer.visible_text(finished),
                token_ids=list(request.output_token_ids),
                logprobs=request.logprobs,
                finish_reason=request.finish_reason,
                stop_reason=request.stop_reason,
            ))
        first = group.samples[0].request
        metrics = {"arrival_time": first.arrival_time}
        if first.first_token_time is not None:
            metrics["first_token_time"] = first.first_token_time
        metrics["now"] = time.monotonic()
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=completions,
            finished=group.finished,
            prompt_logprobs=first.prompt_logprobs,
            num_cached_tokens=first.num_cached_tokens,
            metrics=metrics,
        )


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in SamplingParams.__dataclass_fields__}
