"""The offline API: LLM.generate and LLM.chat over a batch of prompts; LLM.embed, LLM.classify and LLM.score for
pooling models."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import replace

from tqdm import tqdm

from kvforge.engine.engines import Engine, create_engine
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.pooling_engine import PoolingEngine
from kvforge.engine.prompts import PromptType
from kvforge.engine.scoring import cosine_scores, pair_prompts, pair_up
from kvforge.engine_args import build_engine_config, engine_signature
from kvforge.lora.request import LoRARequest
from kvforge.outputs import PoolingRequestOutput, RequestOutput
from kvforge.pooling_params import PoolingParams
from kvforge.reasoning.registry import reasoning_parser
from kvforge.sampling_params import SamplingParams
from kvforge.tokenizer import Tokenizer

Conversation = list[dict]


class LLM:
    """Load a model once, then generate for many prompts at a time with continuous batching.

    A pooling model (runner "pooling": a sentence-transformers folder, an encoder, a classifier or reranker, or
    `runner="pooling"` for a decoder's last hidden state) embeds, classifies and scores instead (`embed`,
    `classify`, `score`).

    `LLM()` runs the default model; keyword arguments are the engine options declared in
    `kvforge.config` (dtype, kv_cache_memory, block_size, ...; `inspect.signature(LLM)` lists them
    with their defaults, and `kvforge generate --help` explains them).

    `shutdown()` (or `close()`, or the end of a `with LLM(...) as llm:` block) releases the model, its KV cache,
    compiled graphs, threads and the other ranks' processes at once; so does dropping the last reference to it.
    """

    def __init__(self, model: str | None = None, **engine_kwargs) -> None:
        self._engine: Engine | None = create_engine(build_engine_config(model=model, **engine_kwargs))

    @property
    def engine(self) -> Engine:
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
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or {"prompt_token_ids": [...]}); outputs in input order. lora_request:
        the LoRA adapter of every prompt, or one per prompt (None: the base model); needs enable_lora=True."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        loras = [lora_request] * len(prompts) if not isinstance(lora_request, Sequence) else list(lora_request)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
        engine = self._engine_of(LLMEngine, "generate")
        for params in sampling_params:  # every grammar compiles in parallel before the first is awaited
            if params.structured_output is not None:
                engine.grammars.compile(params.structured_output)
        return self._run(self._add_all(prompts, sampling_params, loras), use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType], dimensions: int | None = None,
              normalize: bool | None = None, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = False) -> list[PoolingRequestOutput]:
        """One embedding per input (`output.outputs.embedding`), in input order: the first `dimensions` values
        (Matryoshka models), normalised as the checkpoint says unless `normalize` says otherwise."""
        params = PoolingParams("embed", dimensions, normalize, truncate_prompt_tokens)
        return self._pool(prompts, params, use_tqdm)

    def classify(self, prompts: PromptType | Sequence[PromptType], truncate_prompt_tokens: int | None = None,
                 use_tqdm: bool = False) -> list[PoolingRequestOutput]:
        """The class probabilities of each input (`output.outputs.probs`) from the model's classifier head."""
        return self._pool(prompts, PoolingParams("classify", truncate_prompt_tokens=truncate_prompt_tokens), use_tqdm)

    def score(self, queries: str | Sequence[str], documents: str | Sequence[str],
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = False) -> list[PoolingRequestOutput]:
        """The relevance of each (query, document) pair (`output.outputs.score`): one query against every document,
        or queries and documents paired in order. A cross-encoder (a model with a classifier head) reads each pair
        as one input; an embedding model scores the cosine similarity of the two embeddings."""
        queries, documents = pair_up(queries, documents)
        engine = self._engine_of(PoolingEngine, "score")
        if engine.has_classifier:
            params = PoolingParams("score", truncate_prompt_tokens=truncate_prompt_tokens)
            return self._pool(pair_prompts(engine.tokenizer, queries, documents), params, use_tqdm)
        return cosine_scores(self.embed(queries + documents, truncate_prompt_tokens=truncate_prompt_tokens,
                                        use_tqdm=use_tqdm))

    def _pool(self, prompts: PromptType | Sequence[PromptType], params: PoolingParams,
              use_tqdm: bool) -> list[PoolingRequestOutput]:
        self._engine_of(PoolingEngine, params.task)
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        return self._run(self._add_all(prompts, [params] * len(prompts)), use_tqdm)

    def _engine_of(self, kind: type, what: str) -> Engine:
        """The engine, when it is of the kind that can do `what`; ValueError naming the runner otherwise."""
        engine = self.engine
        if not isinstance(engine, kind):
            runner, other = ("pooling", "generate") if kind is PoolingEngine else ("generate", "pooling")
            raise ValueError(f"{what} needs runner {runner!r}, but this LLM runs {engine.model_name} with runner "
                             f"{other!r}; make it with LLM(model, runner={runner!r})")
        return engine

    def _add_all(self, prompts: list[PromptType], params: Sequence[SamplingParams | PoolingParams],
                 loras: Sequence[LoRARequest | None] | None = None) -> list[str]:
        """Queue every prompt (with its LoRA adapter, if any); if one is refused, none stays queued."""
        request_ids = []
        try:
            for i, (prompt, prompt_params) in enumerate(zip(prompts, params)):
                lora = {} if loras is None or loras[i] is None else {"lora_request": loras[i]}
                request_ids.append(self.engine.add_request(None, prompt, prompt_params, **lora))
        except ValueError:
            self.engine.abort_request(request_ids)
            raise
        return request_ids

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate the assistant's reply.

        With a reasoning_parser, a constraint applies after the reply's reasoning (see StructuredOutputParams'
        starts_after); `kvforge.reasoning.registry.reasoning_parser(name).split(text, True)` parts the text."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts = [
            {"prompt_token_ids": tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt,
                                                               tokenize=True)}
            for c in conversations
        ]
        return self.generate(prompts, self._after_reasoning(sampling_params), use_tqdm)

    def _after_reasoning(self, sampling_params: SamplingParams | Sequence[SamplingParams] | None
                         ) -> SamplingParams | Sequence[SamplingParams] | None:
        """The params, each constraint moved after the reasoning when the engine has a reasoning parser."""
        name = self._engine_of(LLMEngine, "chat").config.model.reasoning_parser
        if name is None or sampling_params is None:
            return sampling_params
        end = reasoning_parser(name).end
        if end is None:  # harmony: a constraint is written around the reasoning, not started after it
            return sampling_params

        def moved(params: SamplingParams) -> SamplingParams:
            constraint = params.structured_output
            if constraint is None or constraint.starts_after is not None:
                return params
            return replace(params, structured_output=replace(constraint, starts_after=end))

        return moved(sampling_params) if isinstance(sampling_params, SamplingParams) else [
            moved(p) for p in sampling_params]

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list:
        finished: dict[str, RequestOutput | PoolingRequestOutput] = {}
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
