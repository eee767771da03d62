"""The offline API: LLM.generate and LLM.chat over a batch of prompts."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

from tqdm import tqdm

from kvforge.engine.llm_engine import LLMEngine, PromptType
from kvforge.engine_args import build_engine_config, engine_signature
from kvforge.outputs import RequestOutput
from kvforge.sampling_params import SamplingParams
from kvforge.tokenizer import Tokenizer

Conversation = list[dict]


class LLM:
    """Load a model once, then generate for many prompts at a time with continuous batching.

    `LLM()` runs the default model; keyword arguments are the engine options declared in
    `kvforge.config` (dtype, kv_cache_memory, block_size, ...; `inspect.signature(LLM)` lists them
    with their defaults, and `kvforge generate --help` explains them).

    `shutdown()` (or `close()`, or the end of a `with LLM(...) as llm:` block) releases the model, its KV cache,
    compiled graphs, threads and the other ranks' processes at once; so does dropping the last reference to it.
    """

    def __init__(self, model: str | None = None, **engine_kwargs) -> None:
        self._engine: LLMEngine | None = LLMEngine(build_engine_config(model=model, **engine_kwargs))

    @property
    def engine(self) -> LLMEngine:
        """The engine this LLM drives (RuntimeError once shut down)."""
        if self._engine is None:
            raise RuntimeError("this LLM has been shut down (shutdown(), close() or the end of its with block): "
                               "make a new LLM(...) to generate again")
        return self._engine

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def reset_caches(self) -> None:
        """Forget cached prompt blocks and what finished requests taught the speculative proposer (for example
        between benchmark rounds); requests in flight keep theirs."""
        self.engine.reset_caches()

    def shutdown(self) -> None:
        """Release the model, its KV cache, compiled graphs, threads and the other ranks' processes (with tensor or
        pipeline parallelism). Using the LLM afterwards raises RuntimeError; a second call does nothing."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()

    close = shutdown

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or {"prompt_token_ids": [...]}); outputs in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        for params in sampling_params:  # every grammar compiles in parallel before the first is awaited
            if params.structured_output is not None:
                self.engine.grammars.compile(params.structured_output)
        request_ids = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                request_ids.append(self.engine.add_request(None, prompt, params))
        except ValueError:
            self.engine.abort_request(request_ids)
            raise
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate the assistant's reply."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts = [
            {"prompt_token_ids": tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt,
                                                               tokenize=True)}
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        with tqdm(total=len(request_ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while len(finished) < len(wanted):
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError(f"requests {sorted(wanted - set(finished))} vanished without finishing")
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]


def _init_signature() -> inspect.Signature:
    """(self, model=None, *, dtype="auto", ...): model positional, every other option by keyword."""
    options = list(engine_signature().parameters.values())
    model = options[0].replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD)
    assert model.name == "model"
    self = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return inspect.Signature([self, model, *options[1:]], return_annotation=None)


LLM.__init__.__signature__ = _init_signature()
