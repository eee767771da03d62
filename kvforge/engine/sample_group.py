"""A user request as the engine sees it: one prompt and its n samples, each one scheduler Request."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvforge.engine.detokenizer import IncrementalDetokenizer
from kvforge.engine.request import Request
from kvforge.layers.sampler import RawLogprobs
from kvforge.lora.request import LoRARequest
from kvforge.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from kvforge.sampling_params import SamplingParams
from kvforge.tokenizer import Tokenizer

DecodeLogprobs = Callable[[list[RawLogprobs]], list[PositionLogprobs]]


@dataclass(slots=True, eq=False)
class Sample:
    """One sample's output state, kept by the engine: its text and the logprobs it asked for.

    The Request itself belongs to the scheduler; the engine only reads it."""

    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Detokenize the tokens the step appended; the stop string they complete, if any. The EOS or stop token
        that finished the request is not text (shown with skip_special_tokens false otherwise), unless the
        request includes what stopped it."""
        if self.request.ended_by_stop_token and not self.request.sampling_params.include_stop_str_in_output:
            token_ids = token_ids[:-1]
        for token_id in token_ids:
            stop = self.detokenizer.add_token(token_id)
            if stop is not None:
                return stop
        return None

    def add_prompt_logprobs(self, start: int, chunk: list[RawLogprobs], decode: DecodeLogprobs) -> None:
        """Logprobs of prompt tokens start.. (skipped when a recompute after preemption repeats them)."""
        if self.prompt_logprobs is not None and start == len(self.prompt_logprobs):
            self.prompt_logprobs.extend(decode(chunk))

    def completion(self, index: int) -> CompletionOutput:
        request = self.request
        return CompletionOutput(
            index=index,
            text=self.detokenizer.visible_text(request.status.finished),
            token_ids=list(request.output_token_ids),
            logprobs=self.logprobs,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
        )


@dataclass(slots=True, eq=False)
class SampleGroup:
    """A user request: one prompt, n samples. Sample i is the Request with group_id == request_id and
    sample_index == i; its request id is a unique key for the scheduler and the runner, never parsed."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[Sample]

    @classmethod
    def create(cls, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
               tokenizer: Tokenizer, eos_token_ids: frozenset[int], max_model_len: int,
               lora: LoRARequest | None = None) -> SampleGroup:
        """n samples of one prompt; with a seed, sample i draws from seed + i."""
        samples = []
        for index in range(params.n):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + index
                child_params = dataclasses.replace(params, n=1, seed=seed)
            request = Request(f"{request_id}#{index}", prompt_token_ids, child_params, eos_token_ids,
                              max_model_len, group_id=request_id, sample_index=index, lora=lora)
            detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens,
                                                 params.stop, params.include_stop_str_in_output)
            samples.append(Sample(request, detokenizer,
                                  logprobs=[] if params.logprobs is not None else None,
                                  prompt_logprobs=[None] if params.prompt_logprobs is not None else None))
        return cls(request_id, prompt, prompt_token_ids, samples)

    @property
    def requests(self) -> list[Request]:
        return [s.request for s in self.samples]

    @property
    def finished(self) -> bool:
        return all(s.request.status.finished for s in self.samples)

    def to_output(self) -> RequestOutput:
        first = self.samples[0]
        metrics = {"arrival_time": first.request.arrival_time}
        if first.request.first_token_time is not None:
            metrics["first_token_time"] = first.request.first_token_time
        metrics["now"] = time.monotonic()
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[sample.completion(index) for index, sample in enumerate(self.samples)],
            finished=self.finished,
            prompt_logprobs=first.prompt_logprobs,
            num_cached_tokens=first.request.num_cached_tokens,
            metrics=metrics,
        )


def logprob_decoder(tokenizer: Tokenizer) -> DecodeLogprobs:
    """Raw (token id, logprob, rank) rows -> PositionLogprobs with each token's text."""

    def decode(entries: list[RawLogprobs]) -> list[PositionLogprobs]:
        return [
            {token_id: Logprob(logprob, rank, tokenizer.decode([token_id], skip_special_tokens=False))
             for token_id, logprob, rank in position}
            for position in entries
        ]

    return decode
