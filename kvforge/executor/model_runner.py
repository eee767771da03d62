"""Prepares each step's flat batch, runs the model and samples the next tokens."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from kvforge.config import CompilationConfig
from kvforge.distributed.communicator import recv_tensor, send_tensor
from kvforge.distributed.parallel_state import get_parallel_state
from kvforge.executor.decode_graphs import DecodeGraphs
from kvforge.executor.draft_runner import DraftRequest, DraftRunner
from kvforge.executor.input_batch import InputBatch, StepInputs
from kvforge.executor.recurrent_states import RecurrentStates
from kvforge.layers.attention import AttentionMetadata
from kvforge.layers.kv_cache_spec import KVCacheSpec
from kvforge.layers.sampler import RawLogprobs, Sampler, SamplingBatch, compute_logprobs
from kvforge.loader.heap import release_freed_memory
from kvforge.lora.pool import LoRAPool
from kvforge.spec_decode.proposer import Proposer
from kvforge.spec_decode.verify import verify_drafts
from kvforge.step_data import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from kvforge.structured_output.bitmask import GrammarBitmask


@dataclass(slots=True)
class _Batch:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    metadata: AttentionMetadata
    sample_rows: list[int]  # row of the last token of each request that samples (of each token if drafting)
    sample_requests: list[ScheduledRequest]
    drafts: list[list[int]]  # per sampling request: the draft tokens it verifies (none outside speculation)
    draft_probs: list[torch.Tensor | None]  # per sampling request: its drafts' distributions (None: one-hot)
    prompt_rows: dict[str, tuple[int, int, int]]  # request -> (first row, row count, first position)


class ModelRunner:
    """Owns the model and its KV cache tensors: per layer, the tensors the model's kv_cache_spec names.

    Under pipeline parallelism a stage receives the previous stage's (hidden, residual) and sends its
    own on; under tensor parallelism every rank of the last stage computes the (gathered) logits and
    only the first one samples. execute() returns the sampled tokens on that rank, None elsewhere; with a
    proposer (n-gram, suffix) or a draft model (executor/draft_runner.py), that rank then proposes the drafts of
    every sampling request that asks for them, for its next step, in one call."""

    def __init__(
        self, model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
        kv_cache_spec: KVCacheSpec | None = None, compilation: CompilationConfig | None = None,
        lora: LoRAPool | None = None,
        num_state_slots: int = 0, max_draft_tokens: int = 0, num_state_checkpoints: int = 0, seed: int = 0,
        proposer: Proposer | None = None, draft: DraftRunner | None = None,
    ) -> None:
        self.model = model
        self.lora = lora  # the adapters' slots (their layers attached to the model), None without LoRA
        self.device = device
        self.dtype = dtype
        self.parallel = get_parallel_state()
        self.block_size = block_size
        self.ran_prompt = False  # a step since the last decode-only one ran prompt tokens
        # kv_cache_spec: the model's, or the same stored as int8 / fp8 codes (KVCacheSpec.with_kv_cache_dtype)
        spec = kv_cache_spec or model.kv_cache_spec
        self.kv_caches = spec.allocate(num_blocks, block_size, dtype, device)
        self.num_paged_groups = len(spec.layer_groups())
        # a hybrid model's linear-attention layers: num_state_slots slots of state each, after the paged caches
        self.recurrent_states = None
        if spec.recurrent_state is not None:
            self.recurrent_states = RecurrentStates(spec.recurrent_state, num_state_slots, max_draft_tokens, dtype,
                                                    device, num_state_checkpoints)
            self.kv_caches += self.recurrent_states.layers
        self.sampler = Sampler()
        self.proposer = proposer  # drafts up to max_draft_tokens per request after each step (None: not here)
        self.draft = draft  # the draft model, which does the same (None: not here)
        self.max_draft_tokens = max_draft_tokens
        # the requests' rows between steps; seed: of the engine's generator
        self.requests = InputBatch(self.num_paged_groups, block_size, device, seed,
                                   has_states=self.recurrent_states is not None)
        # decode steps of up to the largest bucket run compiled (compilation None: every step eagerly)
        self.decode_graphs = None
        if compilation is not None:
            max_blocks_per_seq = min(num_blocks, -(-model.config.max_position // block_size))
            padding_slot = None if self.recurrent_states is None else self.recurrent_states.padding_slot
            self.decode_graphs = DecodeGraphs(model, self.kv_caches, compilation.compile_buckets,
                                              compilation.compile_after, max_blocks_per_seq, device,
                                              self.num_paged_groups, padding_slot)
            if draft is not None:
                draft.compile_decode_steps(self.decode_graphs)

    def _prepare(self, output: SchedulerOutput) -> _Batch:
        """The step's flat inputs from the input batch's rows (one host-to-device copy), and what sampling reads."""
        scheduled = output.scheduled
        rows = self.requests.rows_of(scheduled)
        draft_counts = [s.num_draft_tokens for s in scheduled]
        num_drafts = np.array(draft_counts, dtype=np.int64) if any(draft_counts) else None
        step = self.requests.inputs(rows, num_drafts)
        if self.lora is not None:  # each row's adapter slot, in the buffer every LoRA layer reads
            self.lora.prepare_step([self.requests.loras[row] for row in rows.tolist()], step.q_lens)
        (slot_mapping, block_tables), *other_groups = step.group_tables
        metadata = AttentionMetadata(slot_mapping=slot_mapping, query_start_loc=step.query_start_loc,
                                     seq_lens=step.seq_lens, block_tables=block_tables, decode_only=step.decode_only,
                                     other_groups=tuple(other_groups), state_slot_ids=step.state_slot_ids,
                                     has_initial_state=step.has_initial_state)
        if self.recurrent_states is not None:
            metadata.verification_rows = self._recurrent_states_before(scheduled, rows, step)
        # (every request, the list itself, in most steps: the input batch knows its rows then)
        sample_requests = scheduled if all([s.needs_sample for s in scheduled]) else [
            s for s in scheduled if s.needs_sample]
        sample_rows, drafts = self._sample_rows(scheduled, sample_requests, num_drafts, step.starts)
        draft_probs = [None] * len(drafts) if self.draft is None else [
            self.draft.draft_probs(s.request_id, d) if d else None for s, d in zip(sample_requests, drafts)]
        prompt_rows = {}
        if self.requests.num_prompt_logprobs:
            asking = self.requests.int_params[rows, 2] >= 0
            for i in np.flatnonzero(asking & (step.computed < self.requests.num_prompt[rows] - 1)).tolist():
                prompt_rows[scheduled[i].request_id] = (int(step.starts[i]), int(step.q_lens[i]),
                                                        int(step.computed[i]))
        return _Batch(step.input_ids, step.positions, metadata, sample_rows, sample_requests, drafts, draft_probs,
                      prompt_rows)

    @staticmethod
    def _sample_rows(scheduled: list[ScheduledRequest], sample_requests: list[ScheduledRequest],
                     num_drafts: np.ndarray | None, starts: np.ndarray) -> tuple[list[int], list[list[int]]]:
        """The rows of the step's flat batch that sample (each sampling request's last token, and its drafts'
        rows before it), and the drafts each verifies (num_drafts None: no request has any)."""
        if num_drafts is None:
            ends = starts[1:] if len(sample_requests) == len(scheduled) else starts[1:][
                [s.needs_sample for s in scheduled]]
            return (ends - 1).tolist(), [[] for _ in sample_requests]
        needs_sample = np.fromiter((s.needs_sample for s in scheduled), dtype=bool, count=len(scheduled))
        counts = num_drafts[needs_sample] + 1  # its last token and its drafts
        firsts = np.repeat(starts[1:][needs_sample] - counts, counts)
        sample_rows = (firsts + np.arange(len(firsts)) - np.repeat(np.cumsum(counts) - counts, counts)).tolist()
        drafts = [s.token_ids[len(s.token_ids) - s.num_draft_tokens :] for s in sample_requests]
        return sample_rows, drafts

    def _recurrent_states_before(self, scheduled: list[ScheduledRequest], rows: np.ndarray, step: StepInputs
                                 ) -> tuple | None:
        """A hybrid model's states before the step: the previous step's verified drafts are committed and the
        prefix-cache hits' slots take their checkpoints. Returns the verification rows of a step with drafts (or
        None)."""
        self.recurrent_states.commit_accepted(scheduled)
        slot_ids = self.requests.state_slots[rows].tolist()
        self.recurrent_states.load_checkpoints(scheduled, slot_ids)
        if not any(s.num_draft_tokens for s in scheduled):
            return None
        return self.recurrent_states.verification_rows(scheduled, slot_ids, step.q_lens, step.starts)

    def _save_states(self, scheduled: list[ScheduledRequest]) -> None:
        """After a step (on every rank): the state checkpoints it saves take their requests' states."""
        saving = [s for s in scheduled if s.save_state_to is not None]
        if saving:
            slots = self.requests.state_slots[[self.requests.row_of[s.request_id] for s in saving]].tolist()
            self.recurrent_states.save_checkpoints(saving, slots)

    def _allowed_token_bitmask(self, requests: list[ScheduledRequest],
                               grammar_bitmask: GrammarBitmask | None) -> torch.Tensor | None:
        """The step's grammar bitmask, one row per sampling request (all ones when unconstrained)."""
        if grammar_bitmask is None:
            return None
        row_of = {s.request_id: row for row, s in enumerate(requests)}
        rows = np.array([row_of[request_id] for request_id in grammar_bitmask.request_ids], dtype=np.int64)
        bitmask = np.full((len(requests), grammar_bitmask.bitmask.shape[1]), -1, dtype=np.int32)
        bitmask[rows] = grammar_bitmask.bitmask
        return torch.from_numpy(bitmask).to(self.device, non_blocking=True)

    def _sampling_batch(self, requests: list[ScheduledRequest],
                        grammar_bitmask: GrammarBitmask | None = None) -> SamplingBatch:
        return self.requests.sampling_batch(requests, self._allowed_token_bitmask(requests, grammar_bitmask))

    def _prompt_logprobs(self, hidden: torch.Tensor, batch: _Batch) -> dict[str, tuple[int, list[RawLogprobs]]]:
        """Logprobs of the prompt tokens that this step's chunk of each prompt predicts."""
        result = {}
        requests = self.requests
        for request_id, (first_row, num_rows, first_pos) in batch.prompt_rows.items():
            row = requests.row_of[request_id]
            num_rows = min(num_rows, int(requests.num_prompt[row]) - 1 - first_pos)
            logits = self.model.compute_logits(hidden[first_row : first_row + num_rows])
            if logits is None:  # a tensor-parallel peer of the sampling rank
                continue
            targets = torch.from_numpy(requests.token_ids[row, first_pos + 1 : first_pos + 1 + num_rows].copy())
            num_logprobs = [requests.sampling_params[row].prompt_logprobs] * num_rows
            result[request_id] = (first_pos + 1, compute_logprobs(logits, targets.to(logits.device), num_logprobs))
        return result

    def _forward(self, batch: _Batch) -> torch.Tensor | None:
        """The final hidden states [num_tokens, hidden] on the last pipeline stage, None before it."""
        state = self.parallel
        intermediate = None
        if not state.is_first_stage:
            shape = (batch.input_ids.shape[0], self.model.config.hidden_size)
            src = state.stage_rank(state.pp_rank - 1)
            intermediate = tuple(recv_tensor(state, shape, self.dtype, self.device, src) for _ in range(2))
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.metadata, intermediate)
        if state.is_last_stage:
            return hidden
        for tensor in hidden:  # (hidden, residual) to the next stage
            send_tensor(state, tensor, state.stage_rank(state.pp_rank + 1))
        return None

    def _release_prompt_memory(self, decode_only: bool) -> None:
        """On the CPU, the first decode-only step after prompts hands the heap memory freed since back to the system.

        NOTE: a prompt's temporaries (activations of every token of the chunk, tens of MB for a few hundred tokens)
        stay resident in the C heap once freed, and the decode steps that follow need a small part of them: measured,
        1B-class GGUF file, three 128-token prompts each decoding 128 tokens, ~60 MB of freed heap resident at the end
        and the process's peak 40 MB higher than with this. Once after the prompts, not after each chunk of a long
        one (the next chunk takes the same memory back); the next prompt's temporaries are backed anew."""
        if not decode_only:
            self.ran_prompt = True
        elif self.ran_prompt:
            self.ran_prompt = False
            if self.device.type == "cpu":
                release_freed_memory()

    def _runs_compiled(self, batch: _Batch) -> bool:
        """A decode-only step that a compiled bucket holds, with nothing asked of its hidden states (nor drafts to
        verify through linear-attention layers, a position at a time: those steps run eagerly)."""
        graphs = self.decode_graphs
        return (graphs is not None and batch.metadata.decode_only and not batch.prompt_rows
                and batch.metadata.verification_rows is None
                and graphs.bucket_for(batch.input_ids.shape[0]) is not None)

    def _stepping(self) -> AbstractContextManager[None]:
        """Around every step: compiles running in the background pause meanwhile."""
        return nullcontext() if self.decode_graphs is None else self.decode_graphs.stepping()

    def shutdown(self) -> None:
        """Stop the compiles running in the background, if any, and release the draft model and its cache."""
        if self.decode_graphs is not None:
            self.decode_graphs.close()
        if self.draft is not None:
            self.draft.close()
        self.draft = None

    def _update_requests(self, output: SchedulerOutput) -> None:
        """Apply the step's news to the request states (and forget the gone requests' pending draft states); the
        proposer hears of the finished requests' final tokens first."""
        if self.proposer is not None:
            for request_id in output.finished_request_ids:
                self.proposer.finish(request_id, self.requests.token_list(request_id))
            if output.reset_proposer:
                self.proposer.reset()
        self.requests.update(output)
        if self.draft is not None:
            self.draft.forget(output.finished_request_ids + output.preempted_request_ids)
        if self.recurrent_states is not None:
            self.recurrent_states.forget(output.finished_request_ids + output.preempted_request_ids)

    @torch.inference_mode()
    def logits_of_all_tokens(self, output: SchedulerOutput) -> torch.Tensor | None:
        """fp32 logits at every scheduled token: [num_tokens, vocab]. Nothing is sampled, and the
        runner forgets the output's requests afterwards."""
        self._update_requests(output)
        try:
            with self._stepping():
                hidden = self._forward(self._prepare(output))
                return None if hidden is None else self.model.compute_logits(hidden)
        finally:
            self.requests.forget([s.request_id for s in output.scheduled])

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step. The only host sync is reading back the sampled ids (and logprobs if asked)."""
        self._update_requests(output)
        samples = self.parallel.rank == self.parallel.sampler_rank
        result = ModelRunnerOutput() if samples else None
        if not output.scheduled:
            return result
        with self._stepping():
            self._execute(output, result, samples)
        return result

    def _execute(self, output: SchedulerOutput, result: ModelRunnerOutput | None, samples: bool) -> None:
        batch = self._prepare(output)
        self._release_prompt_memory(batch.metadata.decode_only)
        logits = None
        graphs = self.decode_graphs
        if result is not None and graphs is not None:
            result.warmup = graphs.num_compiling > 0  # the step lent the compile some time
        if self._runs_compiled(batch):
            logits = graphs.run(batch.input_ids, batch.positions, batch.metadata)
            if result is not None:
                result.warmup |= logits is None
        hidden = self._forward(batch) if logits is None else None
        self._save_states(output.scheduled)
        if logits is not None:
            if len(batch.sample_rows) < logits.shape[0]:
                logits = logits[batch.sample_rows]
        else:
            if hidden is None:
                return
            if batch.prompt_rows:
                prompt_logprobs = self._prompt_logprobs(hidden, batch)
                if samples:
                    result.prompt_logprobs = prompt_logprobs
            if not batch.sample_rows:
                return
            if len(batch.sample_rows) < hidden.shape[0]:  # (else the rows are every row, in order: no gather)
                hidden = hidden[batch.sample_rows]
            logits = self.model.compute_logits(hidden)  # collective under tensor parallel
        if not samples or not batch.sample_rows:
            return
        self._sample(logits, batch, result, output.grammar_bitmask)

    def _sample(self, logits: torch.Tensor, batch: _Batch, result: ModelRunnerOutput,
                grammar_bitmask: GrammarBitmask | None) -> None:
        """logits [len(batch.sample_rows), vocab] -> each sampling request's tokens (and logprobs) in result."""
        requests = batch.sample_requests
        sampling = self._sampling_batch(requests, grammar_bitmask)
        if any(batch.drafts):
            min_tokens = [self.requests.min_tokens(s.request_id) for s in requests]
            token_ids, logprobs = verify_drafts(logits, sampling, batch.drafts, batch.draft_probs, min_tokens)
        else:
            sampled, raw_logprobs = self.sampler(logits, sampling)
            token_ids = [[token_id] for token_id in sampled]
            logprobs = None if raw_logprobs is None else [[entry] for entry in raw_logprobs]
        for i, s in enumerate(requests):
            result.sampled_token_ids[s.request_id] = token_ids[i]
            if logprobs is not None and sampling.num_logprobs[i] is not None:
                result.logprobs[s.request_id] = logprobs[i]
        if self.proposer is not None or self.draft is not None:
            self._propose(requests, result)

    def _propose(self, requests: list[ScheduledRequest], result: ModelRunnerOutput) -> None:
        """After sampling: each sampling request's tokens take what it sampled in place of its drafts, and the
        proposer (or the draft model) drafts the next step's tokens of those the scheduler asks drafts for, in one
        call."""
        batch = []
        for s in requests:
            token_ids = self.requests.append_sampled(s.request_id, s.num_draft_tokens,
                                                     result.sampled_token_ids[s.request_id])
            if s.propose_drafts:
                batch.append((s.request_id, token_ids))
        if not batch:
            return
        if self.draft is not None:
            drafts = self.draft.propose([self._draft_request(request_id, token_ids) for request_id, token_ids in batch],
                                        self.max_draft_tokens)
        else:
            drafts = self.proposer.propose(batch, self.max_draft_tokens)
        result.draft_token_ids = {request_id: d for (request_id, _), d in zip(batch, drafts, strict=True) if d}

    def _draft_request(self, request_id: str, token_ids: list[int]) -> DraftRequest:
        """What the draft model reads of a request: its tokens, sampling parameters and first group's blocks."""
        requests = self.requests
        row = requests.row_of[request_id]
        block_table = requests.block_tables[0, row, : requests.num_blocks[0, row]]
        return DraftRequest(request_id, token_ids, requests.sampling_params[row], block_table)
