"""One rank of the engine: its share of the model, its KV cache and its model runner.

With one device the engine holds the only worker in-process. With several, every rank (the
driver's included) holds one, and each step every worker runs the same SchedulerOutput: the ranks
of a stage split each layer (tensor parallel), the stages pass hidden states on (pipeline parallel),
and the last stage's first rank samples.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

import torch
import torch.distributed as dist

from kvforge.config import CompilationConfig, EngineConfig
from kvforge.distributed.parallel_state import ParallelState, building_with, get_parallel_state
from kvforge.executor.draft_runner import DraftLimits, DraftRunner, draft_paged_spec
from kvforge.executor.draft_states import DraftStates
from kvforge.executor.kv_cache_memory import KVCacheSize, memory_limits, size_kv_cache
from kvforge.executor.model_info import ModelInfo
from kvforge.executor.model_runner import ModelRunner
from kvforge.kernels.cpu.extension import keep_python_memory
from kvforge.kernels.ops import OpTable, building_with_ops, op_table
from kvforge.layers.rotary import keep_positions
from kvforge.loader.model_loader import LoadedModel, load_model
from kvforge.lora.pool import LoRAPool
from kvforge.lora.request import LoRARequest
from kvforge.spec_decode.draft import draft_model_config
from kvforge.spec_decode.proposer import Proposer, create_proposer
from kvforge.step_data import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class RankProfiler(Protocol):
    """A hook that records a worker's batches (`kvforge profile`'s, for the ranks other than the engine's): passed to
    the worker by its executor (Worker.start_profile), never patched in."""

    def start(self, worker: Worker) -> None:
        """Start recording worker's batches (its runner is built)."""

    def stop(self, worker: Worker) -> None:
        """Stop recording and write out what was recorded (before the rank leaves its process group)."""


def load_with_ops(config: EngineConfig, device: torch.device, kv_cache_bytes: int = 0,
                  runner: str = "generate") -> tuple[OpTable, LoadedModel]:
    """The engine's op table for the device (config.device.attention_backend) and the model built with it."""
    backend = config.device.attention_backend
    if backend == "auto" and device.type == "cpu":
        backend = "torch"  # a GPU machine told to run on its CPU
    if device.type == "cpu":
        keep_python_memory()
    ops = op_table(None if backend == "auto" else backend)
    with building_with_ops(ops):
        return ops, load_model(config.model, device, kv_cache_bytes, runner)


class Worker:
    """Loads this rank's shard of the model; `init_cache` then allocates its paged KV cache; `shutdown` releases
    both."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        # NOTE: a cache sized by default fits the memory left after the load (kv_cache_memory.py); one asked for
        # counts in the load's check that the model fits
        kv_cache_bytes = (config.cache.kv_cache_memory or 0) if device.type == "cpu" else 0
        self.ops, loaded = load_with_ops(config, device, kv_cache_bytes)
        self.loaded: LoadedModel | None = loaded
        self.attention_backend = self.ops.backend
        # NOTE: the CPU's C++ and torch attention kernels widen 16-bit cache rows under float32 queries; the Triton
        # kernels (GPUs, or the interpreter) read the query dtype
        widening = device.type == "cpu" and self.attention_backend == "torch"
        self.kv_cache_spec = self.loaded.model.kv_cache_spec.with_kv_cache_dtype(
            config.cache.kv_cache_dtype, self.loaded.dtype, widening, self.ops.platform)
        self.bytes_per_token = self.kv_cache_spec.bytes_per_token(self.loaded.dtype)
        max_position = self.loaded.model.config.max_position
        self.max_model_len = min(config.model.max_model_len or max_position, max_position)
        # the draft model of speculative decoding (on the sampling rank), whose KV cache shares the target's block
        # ids: a block's bytes are the target's and the draft's
        self.draft: LoadedModel | None = None
        self.draft_kv_cache_spec = None
        if config.speculative.speculative_method == "draft" and self._samples():
            self._load_draft(widening)
            self.bytes_per_token += draft_paged_spec(self.draft_kv_cache_spec).bytes_per_token(self.draft.dtype)
        # NOTE: before the KV cache is sized, so that its memory comes out of the cache's (the experts' slots of a MoE
        # model take gigabytes)
        self.lora_pool = self._lora_pool()
        self.runner: ModelRunner | None = None
        self.profiler: RankProfiler | None = None  # recording this rank's batches, between start and stop_profile

    @property
    def model_info(self) -> ModelInfo:
        loaded, config = self.loaded, self.loaded.model.config
        spec = self.kv_cache_spec
        return ModelInfo(loaded.name, loaded.hf_config, loaded.tokenizer, loaded.dtype, config.vocab_size,
                         self.max_model_len, self.bytes_per_token, spec.code_dtype or spec.value_dtype or loaded.dtype,
                         self.device, self.attention_backend, spec.cache_groups())

    @property
    def model(self) -> torch.nn.Module:
        """This rank's share of the model, for tools and tests that read its weights."""
        return self.loaded.model

    def kv_cache_bytes(self) -> int:
        """Bytes of this rank's allocated KV cache tensors (0 before init_cache)."""
        caches = self.runner.kv_caches if self.runner is not None else []
        tensors = {id(t): t for layer in caches for t in layer}  # NOTE: layer groups share slot tensors
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def kv_cache_size(self) -> KVCacheSize:
        """The blocks this rank's cache would have, and why (across ranks the smallest wins: agree_kv_cache_size)."""
        cache = self.config.cache
        max_num_seqs = self.config.scheduler.max_num_seqs
        limits = memory_limits(self.device, cache.gpu_memory_utilization)
        per_request, fixed = self._state_bytes()
        if per_request:  # NOTE: the state slots (a running request's and the padding slot, and their scratch)
            # and the checkpoints of the prefix cache come out of the same memory
            max_num_seqs = self._requests_whose_states_fit(max_num_seqs, per_request, fixed, limits)
            state_bytes = fixed + max_num_seqs * per_request
            limits = [(f"{what} less {state_bytes / 2**20:.1f} MiB of linear-attention states",
                       max(limit - state_bytes, 0)) for what, limit in limits]
        return size_kv_cache(cache.kv_cache_memory, max_num_seqs, self.max_model_len, cache.block_size,
                             self.bytes_per_token, limits)

    def _state_bytes(self) -> tuple[int, int]:
        """The linear-attention states of a hybrid target and a hybrid draft: (bytes per running request, bytes of
        padding slots and prefix-cache checkpoints); (0, 0) without such layers."""
        per_request = fixed = 0
        states = self.kv_cache_spec.recurrent_state
        if states is not None:
            slot_bytes = states.bytes_per_slot(self.loaded.dtype)
            per_request = (1 + (self._max_draft_tokens() + 1 if self._max_draft_tokens() else 0)) * slot_bytes
            fixed = per_request + self._num_state_checkpoints() * slot_bytes
        draft_states = None if self.draft is None else self.draft_kv_cache_spec.recurrent_state
        if draft_states is not None:
            per_request += DraftStates.bytes_per_request(draft_states, self.draft.dtype)
            fixed += draft_states.bytes_per_slot(self.draft.dtype)
        return per_request, fixed

    def _requests_whose_states_fit(self, max_num_seqs: int, per_request: int, fixed: int,
                                   limits: list[tuple[str, int]]) -> int:
        """max_num_seqs, or fewer: a hybrid model's states take at most half of the smallest memory limit (by
        default the rest is the KV blocks'; a --kv-cache-memory asked for is the blocks' alone, as for any model)."""
        what, budget = min(limits, key=lambda limit: limit[1])
        fits = (budget // 2 - fixed) // per_request
        if fits < 1:
            raise ValueError(f"a running request's linear-attention states ({per_request / 2**20:.1f} MiB) and "
                             f"{fixed / 2**20:.1f} MiB of padding slot and prefix-cache checkpoints "
                             f"(--num-state-checkpoints) do not fit in half of {what} ({budget / 2**20:.0f} MiB)")
        if fits < max_num_seqs:
            logger.info("at most %d requests run at once (not max_num_seqs %d): each holds %.1f MiB of "
                        "linear-attention states, which take at most half of %s", fits, max_num_seqs,
                        per_request / 2**20, what)
        return min(max_num_seqs, fits)

    def _num_state_checkpoints(self) -> int:
        """A hybrid model's linear-attention states kept for the prefix cache (none without prefix caching)."""
        cache = self.config.cache
        return cache.num_state_checkpoints if cache.enable_prefix_caching else 0

    def _samples(self) -> bool:
        """Whether this rank samples (and proposes the drafts)."""
        state = get_parallel_state()
        return state.rank == state.sampler_rank

    def _load_draft(self, widening: bool) -> None:
        """The draft model, loaded whole on this rank (one rank's world) with the target's op table and device."""
        with building_with(ParallelState()), building_with_ops(self.ops):
            self.draft = load_model(draft_model_config(self.config), self.device)
        draft, target = self.draft.model, self.loaded.model
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft.config.vocab_size} tokens) is not the "
                             f"target's ({target.config.vocab_size})")
        # NOTE: group 0 of a paged cache is its full-attention layers, unless every layer slides (in windows of two
        # sizes or more)
        if self.kv_cache_spec.layer_groups()[0].kind != "full_attention":
            raise ValueError("a draft model needs a target with full-attention layers (their blocks hold the "
                             "draft's keys and values)")
        # NOTE: a latent-attention (MLA) draft keeps its cache unquantized whatever the target's
        kv_cache_dtype = self.config.cache.kv_cache_dtype if draft.kv_cache_spec.quantizable else "auto"
        self.draft_kv_cache_spec = draft.kv_cache_spec.with_kv_cache_dtype(kv_cache_dtype, self.draft.dtype, widening,
                                                                           self.ops.platform)

    def _draft_runner(self, size: KVCacheSize) -> DraftRunner | None:
        """The draft model with its KV cache of the target's block count, if this rank drafts."""
        if self.draft is None:
            return None
        block_size = self.config.cache.block_size
        draft_bytes = size.num_blocks * block_size * draft_paged_spec(self.draft_kv_cache_spec).bytes_per_token(
            self.draft.dtype)
        logger.info("draft model %s: KV cache of %d blocks beside the target's, %.1f MiB (of the KV cache's budget)",
                    self.draft.name, size.num_blocks, draft_bytes / 2**20)
        limits = DraftLimits(min(self.max_model_len, self.draft.model.config.max_position), size.max_num_seqs,
                             self.config.scheduler.max_num_batched_tokens)
        return DraftRunner(self.draft.model, self.draft_kv_cache_spec, size.num_blocks, block_size, self.draft.dtype,
                           self.device, limits, self.config.seed)

    def _max_draft_tokens(self) -> int:
        """The most drafts a request verifies in a step (0: no speculation)."""
        spec = self.config.speculative
        return 0 if spec.speculative_method is None else spec.num_speculative_tokens

    def init_cache(self, size: KVCacheSize) -> None:
        compilation = self._compilation()
        if self.kv_cache_spec.layer_groups()[0].kind == "full_attention":
            # NOTE: every token's keys and values stay in a block of the full-attention layers' table, which holds
            # at most num_blocks blocks: no position reaches num_blocks * block_size (before anything compiles)
            keep_positions(self.loaded.model, size.num_blocks * self.config.cache.block_size)
        self.runner = ModelRunner(self.loaded.model, size.num_blocks, self.config.cache.block_size,
                                  self.loaded.dtype, self.device, self.kv_cache_spec, compilation, self.lora_pool,
                                  num_state_slots=size.max_num_seqs,
                                  max_draft_tokens=self._max_draft_tokens(),
                                  num_state_checkpoints=self._num_state_checkpoints(), seed=self.config.seed,
                                  proposer=self._proposer(), draft=self._draft_runner(size))
        if compilation is not None and compilation.compile_at_start:
            self.runner.decode_graphs.compile_ahead(max_decode_rows(self.config), wait=False)
            if self.runner.draft is not None:  # the draft's decode steps: one row per drafting request
                self.runner.draft.graphs.compile_ahead(size.max_num_seqs, wait=False)

    def _proposer(self) -> Proposer | None:
        """The n-gram or suffix proposer, on the sampling rank (the one that knows the sampled tokens)."""
        return create_proposer(self.config.speculative) if self._samples() else None

    def _lora_pool(self) -> LoRAPool | None:
        """The adapters' slots, attached to the model's layers (with enable_lora); sized for the longest step: a
        prefill chunk, a decode bucket, or a whole sequence scored at once."""
        config = self.config
        if not config.lora.enable_lora:
            return None
        max_tokens = max(config.scheduler.max_num_batched_tokens, self.max_model_len, max_decode_rows(config),
                         config.compilation.compile_buckets[-1])
        return LoRAPool(self.loaded.model, config.lora, max_tokens, self.loaded.dtype, self.device, self.ops)

    def load_lora(self, lora: LoRARequest) -> None:
        """Read and check an adapter into this rank's host registry (ValueError naming a bad one)."""
        if self.runner.lora is None:
            raise ValueError(f"LoRA adapter {lora.name!r} given to an engine without LoRA: make it with "
                             f"enable_lora=True")
        self.runner.lora.load(lora)

    def start_profile(self, profiler: RankProfiler) -> None:
        """Record this rank's batches with profiler until stop_profile (after init_cache)."""
        if self.profiler is not None:
            raise RuntimeError("this worker is already being profiled: stop_profile() first")
        profiler.start(self)
        self.profiler = profiler

    def stop_profile(self) -> None:
        """Stop the profiler started by start_profile, which writes out what it recorded (none running: nothing)."""
        profiler, self.profiler = self.profiler, None
        if profiler is not None:
            profiler.stop(self)

    def shutdown(self) -> None:
        """Stop this rank's compiles in the background and release the model, its KV cache and its compiled graphs;
        the worker runs no step afterwards."""
        if self.runner is not None:
            self.runner.shutdown()
        self.runner = None
        self.lora_pool = None
        self.loaded = None
        self.draft = None

    def _compilation(self) -> CompilationConfig | None:
        """How decode steps compile, or None (every step eager) when asked, under tensor or pipeline
        parallelism (collectives run eagerly), or when the ops do not trace (the CPU without its C++ kernels)."""
        compilation = self.config.compilation
        if compilation.enforce_eager:
            return None
        reason = ("tensor/pipeline parallelism" if get_parallel_state().world_size > 1
                  else None if self.ops.traces else "ops that do not trace (no C++ CPU kernels)")
        if reason is not None:
            logger.info("decode steps run eagerly: %s", reason)
            return None
        return self._with_verification_buckets(compilation)

    def _with_verification_buckets(self, compilation: CompilationConfig) -> CompilationConfig:
        """With speculation, a verification step where every request drafts in full has num_speculative_tokens
        + 1 rows per request: buckets of exactly those row counts (within speculative_max_rows), so its steps
        are not padded. They compile as the others do, in the background on first use (decode_graphs.py).

        NOTE: padding rows cost as much as real ones where the weight GEMV is compute-bound (the CPU): a
        5-row step padded to 8 measured 1.82x single-stream speed-up on the grounded workload, unpadded 2.29x."""
        spec = self.config.speculative
        if spec.speculative_method is None:
            return compilation
        rows = spec.num_speculative_tokens + 1
        largest = compilation.compile_buckets[-1]
        extra = {rows * n for n in range(1, spec.speculative_max_rows // rows + 1) if rows * n <= largest}
        return dataclasses.replace(compilation, compile_buckets=tuple(sorted(set(compilation.compile_buckets) | extra)))

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run this rank's part of a step; the sampling rank returns the sampled tokens, others None."""
        return self.runner.execute(output)

    def score(self, output: SchedulerOutput) -> torch.Tensor | None:
        """fp32 logits of every scheduled token on the sampling rank, None elsewhere."""
        return self.runner.logits_of_all_tokens(output)


def max_decode_rows(config: EngineConfig) -> int:
    """The most token rows of an engine's decode step: its batch's sequences, with speculation their drafts too."""
    spec = config.speculative
    rows = config.scheduler.max_num_seqs
    return rows if spec.speculative_method is None else max(rows, spec.speculative_max_rows)


def agree_kv_cache_size(worker: Worker, state: ParallelState) -> KVCacheSize:
    """Every rank must index the same block ids and run the same requests: take the smallest block count and
    request count of all ranks."""
    size = worker.kv_cache_size()
    if state.world_size == 1:
        return size
    counts = torch.tensor([size.num_blocks, size.max_num_seqs], dtype=torch.int64)
    dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=state.cpu_group)
    num_blocks, max_num_seqs = (int(count) for count in counts.tolist())
    limit = size.limit if num_blocks == size.num_blocks else "another rank's limit"
    return KVCacheSize(num_blocks, limit, max_num_seqs)
