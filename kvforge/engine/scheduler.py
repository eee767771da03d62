"""Continuous batching under one token budget per step, with chunked prefill and preemption."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvforge.config import SchedulerConfig
from kvforge.engine.kv_cache_manager import KVCacheManager, PrefixHit
from kvforge.engine.request import Request, RequestStatus
from kvforge.engine.speculation import Speculation
from kvforge.engine.stats import SchedulerStats, SpecDecodeStats
from kvforge.step_data import ModelRunnerOutput, NewRequest, ScheduledRequest, SchedulerOutput
from kvforge.structured_output.bitmask import GrammarBitmask


@dataclass(slots=True)
class StepResult:
    """What one step changed, for the engine to turn into outputs.

    advanced: the requests computed in the step (in batch order), including those that finished in
    it; new_token_ids: the tokens each of them appended (several when speculating, none for a prefill
    chunk); finished: the requests that stopped on a stop token or a length limit (blocks freed)."""

    advanced: list[Request] = field(default_factory=list)
    new_token_ids: dict[str, list[int]] = field(default_factory=dict)
    finished: list[Request] = field(default_factory=list)


class Scheduler:
    """Picks each step's work: running requests first (decodes and unfinished prefills, oldest
    first), then waiting requests in arrival order while the token budget and blocks last.

    When a running request cannot get a block, the newest running request is preempted: its blocks
    are freed and it goes back to the front of the waiting queue, to be recomputed later.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 speculation: Speculation | None = None, max_loras: int | None = None) -> None:
        self.config = config
        self.max_loras = max_loras  # most LoRA adapters among the running requests (the runner's slots)
        self.kv = kv_cache_manager
        self.speculation = speculation
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished_ids: list[str] = []
        self.num_preemptions = 0
        # request id -> how many of its block ids the runner holds (present: the runner knows the request)
        self.num_sent_blocks: dict[str, int] = {}

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def stats(self) -> SchedulerStats:
        spec = self.speculation.stats() if self.speculation is not None else SpecDecodeStats()
        return SchedulerStats(num_running=len(self.running), num_waiting=len(self.waiting),
                              num_preemptions=self.num_preemptions, spec_decode=spec)

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Sequence[str], status: RequestStatus,
                        stop_reason: int | str | None = None) -> None:
        """Remove requests (finished or aborted) and free their blocks at once.

        stop_reason: the stop string (or token) that finished them, when the caller found it."""
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            if stop_reason is not None:
                request.stop_reason = stop_reason
            self.kv.free(request)
            self.num_sent_blocks.pop(request_id, None)
            if self.speculation is not None:
                self.speculation.finish(request)
            self.finished_ids.append(request_id)

    def _chunk(self, request: Request, budget: int) -> int:
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        threshold = self.config.long_prefill_token_threshold
        return self.kv.cut_chunk(request, min(num_new, threshold) if threshold > 0 else num_new)

    def _preempt_newest(self, output: SchedulerOutput, busy: set[str]) -> Request:
        """Free the newest running request that is not in a step in flight (the caller is not)."""
        index = max(i for i, r in enumerate(self.running) if r.request_id not in busy)
        victim = self.running.pop(index)
        self.kv.free(victim)
        self.num_sent_blocks.pop(victim.request_id, None)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        output.preempted_request_ids.append(victim.request_id)
        if self.speculation is not None:
            self.speculation.preempt(victim)
        return victim

    def _emit(self, output: SchedulerOutput, request: Request, num_new: int, drafts: Sequence[int] = ()) -> None:
        request_id, start = request.request_id, request.num_computed_tokens
        num_sent = self.num_sent_blocks.get(request_id)
        if num_sent is None:
            output.new_requests.append(NewRequest(request_id, list(request.all_token_ids),
                                                  request.num_prompt_tokens, request.sampling_params, request.lora))
        block_tables = self.kv.get_block_tables(request_id)  # NOTE: every group's table is equally long
        self.num_sent_blocks[request_id] = len(block_tables[0])
        load_state_from, save_state_to = self.kv.state_copies(request, num_new, len(drafts))
        output.scheduled.append(ScheduledRequest(
            request_id=request_id,
            token_ids=request.all_token_ids[start : start + num_new] + list(drafts),
            num_computed_tokens=start,
            new_block_ids=[table[num_sent or 0 :] for table in block_tables],
            num_prompt_tokens=request.num_prompt_tokens,
            needs_sample=start + num_new == request.num_tokens,
            banned_token_ids=self._banned_tokens(request),
            num_draft_tokens=len(drafts),
            propose_drafts=self._proposes_after(request, start + num_new),
            load_state_from=load_state_from,
            save_state_to=save_state_to,
        ))

    @staticmethod
    def _banned_tokens(request: Request) -> list[int]:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            return []
        eos = [] if params.ignore_eos else list(request.eos_token_ids)
        return eos + params.stop_token_ids

    def _schedule_running(self, output: SchedulerOutput, budget: int, busy: set[str], max_seqs: int) -> int:
        index = 0
        if self.speculation is not None:
            self.speculation.plan([r for r in self.running if r.request_id not in busy and self._decodes(r)])
        while index < len(self.running) and budget > 0 and len(output.scheduled) < max_seqs:
            request = self.running[index]
            if request.request_id in busy:
                index += 1
                continue
            num_new = self._chunk(request, budget)
            drafts = self._drafts(request, budget)
            if drafts and self._allocate(request, num_new + len(drafts)):
                self._emit(output, request, num_new, drafts)
                budget -= num_new + len(drafts)
                index += 1
                continue
            while not self._allocate(request, num_new):
                if self._preempt_newest(output, busy) is request:
                    return budget
            self._emit(output, request, num_new)
            budget -= num_new
            index += 1
        return budget

    @staticmethod
    def _decodes(request: Request) -> bool:
        """Whether the request decodes (one token left to compute) and may carry drafts."""
        # NOTE: a grammar's bitmask is built for the next token only: constrained requests do not draft
        return request.num_tokens - request.num_computed_tokens == 1 and request.grammar is None

    def _proposes_after(self, request: Request, num_computed: int) -> bool:
        """Whether the runner proposes drafts after a step that computes the request up to num_computed tokens."""
        speculation = self.speculation
        return (speculation is not None and num_computed == request.num_tokens and request.grammar is None
                and speculation.wants_drafts(request))

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """Draft tokens (as many as the step's plan allows) for a request that decodes."""
        if self.speculation is None or not self._decodes(request):
            return []
        return self.speculation.drafts(request, budget)

    def _allocate(self, request: Request, num_new: int, hit: PrefixHit | None = None) -> bool:
        """allocate_slots for num_new tokens, and first try with the lookahead of a draft model that writes its
        drafts' keys and values past them (without it, the runner drafts as many tokens as the blocks hold)."""
        lookahead = 0 if self.speculation is None else self.speculation.lookahead
        if lookahead and request.num_computed_tokens + num_new >= request.num_tokens and (
                self.kv.allocate_slots(request, num_new + lookahead, hit)):
            return True
        return self.kv.allocate_slots(request, num_new, hit)

    def _adapter_fits(self, request: Request) -> bool:
        """Whether the request's LoRA adapter (if any) runs already or a slot is left for it."""
        if request.lora is None or self.max_loras is None:
            return True
        running = {r.lora.int_id for r in self.running if r.lora is not None}
        return request.lora.int_id in running or len(running) < self.max_loras

    def _schedule_waiting(self, output: SchedulerOutput, budget: int, max_seqs: int) -> None:
        while (self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs
               and len(output.scheduled) < max_seqs):
            request = self.waiting[0]
            if not self._adapter_fits(request):  # waits for a running adapter's requests to finish
                break
            hit = self.kv.find_cached_prefix(request)
            num_cached_tokens = hit.num_blocks * self.kv.block_size
            request.num_computed_tokens = num_cached_tokens
            num_new = self._chunk(request, budget)
            if not self._allocate(request, num_new, hit):
                request.num_computed_tokens = 0
                break
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached_tokens
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._emit(output, request, num_new)
            budget -= num_new

    def schedule(self, busy: set[str] | frozenset[str] = frozenset(), num_micro_batches: int = 1) -> SchedulerOutput:
        """Build one step. Invariant: every scheduled request has blocks for all its new tokens.

        Pipeline parallelism keeps num_micro_batches steps in flight: each takes an equal share of
        the unfinished requests, and busy (the requests of steps in flight) are neither scheduled
        nor preempted until their results are back."""
        output = SchedulerOutput(finished_request_ids=self.finished_ids)
        self.finished_ids = []
        if self.speculation is not None:
            output.reset_proposer = self.speculation.take_reset()
        max_seqs = max(1, -(-self.num_unfinished // num_micro_batches))
        budget = self._schedule_running(output, self.config.max_num_batched_tokens, set(busy), max_seqs)
        if not output.preempted_request_ids:
            self._schedule_waiting(output, budget, max_seqs)
        return output

    def grammar_bitmask(self, output: SchedulerOutput, num_words: int) -> GrammarBitmask | None:
        """The allowed next tokens of the constrained requests that sample in the step `output`."""
        requests = (self.requests[s.request_id] for s in output.scheduled if s.needs_sample)
        return GrammarBitmask.build(((r.request_id, r.grammar) for r in requests if r.grammar is not None),
                                    num_words)

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> StepResult:
        """Apply a step's result: the one place that changes requests after a step.

        Every computed request advances by the tokens it was scheduled; each sampling request appends
        its sampled tokens one at a time, up to the first that hits a stop token or a length limit
        (tokens past it are dropped); finished requests are removed and their blocks freed. Requests
        aborted while the step was in flight are skipped."""
        result = StepResult()
        finished: dict[RequestStatus, list[str]] = {}
        saved = [s.save_state_to for s in scheduler_output.scheduled if s.save_state_to is not None]
        if saved:  # NOTE: those of requests aborted while the step was in flight too: the runner saved them
            self.kv.states_saved(saved)
        for scheduled in scheduler_output.scheduled:
            request = self.requests.get(scheduled.request_id)
            if request is None:  # aborted while its step was in flight
                continue
            request.num_computed_tokens += len(scheduled.token_ids) - scheduled.num_draft_tokens
            result.advanced.append(request)
            token_ids = runner_output.sampled_token_ids.get(request.request_id)
            if not token_ids:
                continue
            accepted, status = self._append_tokens(request, token_ids)
            if self.speculation is not None:
                self.speculation.take(request.request_id, runner_output.draft_token_ids)
            if scheduled.num_draft_tokens:
                self._accept_drafts(request, scheduled.num_draft_tokens, len(token_ids) - 1)
            result.new_token_ids[request.request_id] = accepted
            if status is not None:
                finished.setdefault(status, []).append(request.request_id)
                result.finished.append(request)
        for status, request_ids in finished.items():
            self.finish_requests(request_ids, status)
        return result

    def record_step_time(self, output: SchedulerOutput, seconds: float) -> None:
        """The step `output` took seconds from scheduling to its update: the speculation policy's cost of
        decode-only steps (every request decoding, with or without drafts), by token rows."""
        if self.speculation is None or not output.scheduled:
            return
        if all(len(s.token_ids) == 1 + s.num_draft_tokens for s in output.scheduled):
            self.speculation.record_step(output.num_batched_tokens, seconds)

    def _accept_drafts(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """After the tokens the model returned are appended: the accepted drafts' keys and values are in the
        cache; the rejected ones' are past num_computed_tokens, to be overwritten."""
        self.speculation.record(request.request_id, num_drafts, num_accepted)
        request.num_computed_tokens += num_accepted
        self.kv.register_accepted(request)

    @staticmethod
    def _append_tokens(request: Request, token_ids: list[int]) -> tuple[list[int], RequestStatus | None]:
        """Append tokens until one finishes the request; the appended tokens and the finish status."""
        if request.sampling_params.max_tokens == 0:  # the prompt only (scored): its sampled token is dropped
            return [], RequestStatus.FINISHED_LENGTH
        for count, token_id in enumerate(token_ids, start=1):
            if request.grammar is not None:  # the bitmask allowed only what the grammar accepts
                accepted = request.grammar.advance([token_id])
                assert accepted == 1, f"token {token_id} is outside {request.request_id}'s grammar"
            request.append_output_token(token_id)
            status = request.check_stop_token()
            if status is not None:
                return token_ids[:count], status
        return list(token_ids), None
