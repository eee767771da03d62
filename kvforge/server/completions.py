"""POST /v1/completions: text or token-id prompts (one or many), streamed or not, with echo and logprobs;
max_tokens 0 with echo and logprobs scores the prompt; suffix fills in the middle; best_of ranks candidates."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Request
from starlette.responses import Response

from kvforge.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from kvforge.server.best_of import best_completions, num_candidates
from kvforge.server.errors import APIError
from kvforge.server.fill_in_middle import fill_in_middle_prompt
from kvforge.server.logprob_views import prompt_logprobs, token_name
from kvforge.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from kvforge.server.request_fields import check_fields
from kvforge.server.serving import (
    ChoiceProgress,
    RequestGroup,
    ServerState,
    json_response,
    max_tokens_in_context,
    new_request_id,
    off_loop_if_large,
    sampling_params,
    sse,
    sse_response,
    usage,
)
from kvforge.tokenizer import Tokenizer

router = APIRouter()


@dataclass(slots=True)
class _Prompt:
    text: str | None  # as given, for echo; None for token ids
    token_ids: list[int]


async def _prompts(tokenizer: Tokenizer, prompt: str | list, suffix: str | None) -> list[_Prompt]:
    """The prompts as token ids; with a suffix, each text prompt is the prefix of a fill-in-the-middle prompt."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif not prompt:
        raise APIError(400, "prompt must not be an empty list", param="prompt")
    if isinstance(prompt[0], str):
        if suffix:
            try:
                prompt = [fill_in_middle_prompt(tokenizer, text, suffix) for text in prompt]
            except ValueError as error:
                raise APIError(400, str(error), param="suffix") from error
        num_chars = sum(len(text) for text in prompt)
        token_ids = await off_loop_if_large(num_chars, lambda: [tokenizer.encode(text) for text in prompt])
        return [_Prompt(text, ids) for text, ids in zip(prompt, token_ids, strict=True)]
    if suffix:
        raise APIError(400, "suffix needs a text prompt (the code before the gap), not token ids", param="suffix")
    if isinstance(prompt[0], int):
        return [_Prompt(None, list(prompt))]
    return [_Prompt(None, list(token_ids)) for token_ids in prompt]


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, http_request: Request) -> Response:
    state: ServerState = http_request.app.state.server
    model = state.check_model(body.model)
    headers = check_fields(body)
    if body.suffix and body.echo:
        raise APIError(400, "suffix cannot be combined with echo", param="suffix")
    num_samples = num_candidates(body)
    prompts = await _prompts(state.engine.tokenizer, body.prompt, body.suffix)
    # NOTE: best_of ranks the candidates by their tokens' logprobs, returned only if the request asked
    extra = {"logprobs": 0 if body.logprobs is None and num_samples > body.n else body.logprobs,
             "prompt_logprobs": body.prompt_logprobs}
    if body.echo and body.logprobs is not None and body.prompt_logprobs is None:
        extra["prompt_logprobs"] = body.logprobs
    requests = []
    for prompt in prompts:
        max_tokens = max_tokens_in_context(state, len(prompt.token_ids), body.max_tokens)
        params = dataclasses.replace(sampling_params(state, body, max_tokens, **extra), n=num_samples)
        requests.append(({"prompt_token_ids": prompt.token_ids}, params))
    request_id = new_request_id("cmpl")
    group = RequestGroup(state)
    await group.start(request_id, requests, lora=state.lora_for(model))
    view = _ChoiceView(state.engine.tokenizer, body, prompts)
    if body.stream:
        return sse_response(group, _stream(group, view, request_id, model), headers)
    outputs = await group.final_outputs(http_request)
    returned = [best_completions(o, body.n) for o in outputs] if num_samples > body.n else outputs
    choices = [view.choice(i, o, c, 0, 0) for i, o in enumerate(returned) for c in o.outputs]
    # NOTE: usage counts every candidate generated, as OpenAI billed best_of
    return json_response(CompletionResponse(id=request_id, model=model, choices=choices, usage=usage(outputs)),
                         headers)


async def _stream(group: RequestGroup, view: _ChoiceView, request_id: str, model: str) -> AsyncIterator[str]:
    finals: dict[int, RequestOutput] = {}
    sent: dict[int, ChoiceProgress] = {}
    async for prompt_index, output in group.outputs():
        for completion in output.outputs:
            progress = sent.setdefault(prompt_index * view.n + completion.index, ChoiceProgress())
            if not progress.has_news(completion):
                continue
            num_chars, num_tokens, first = progress.advance(completion)
            choice = view.choice(prompt_index, output, completion, num_chars, num_tokens, echo=first)
            yield sse(CompletionResponse(id=request_id, model=model, choices=[choice]))
        if output.finished:
            finals[prompt_index] = output
    if view.include_usage:
        outputs = [finals[i] for i in sorted(finals)]
        yield sse(CompletionResponse(id=request_id, model=model, choices=[], usage=usage(outputs)))


class _ChoiceView:
    """Turns a completion (or the part of it after what was already sent) into an OpenAI choice."""

    def __init__(self, tokenizer: Tokenizer, body: CompletionRequest, prompts: list[_Prompt]) -> None:
        self.tokenizer = tokenizer
        self.n = body.n
        self.num_logprobs = body.logprobs
        self.with_prompt_logprobs = body.prompt_logprobs is not None
        self.tokens_as_ids = body.return_tokens_as_token_ids
        self.include_usage = body.include_usage_in_stream
        self.prompts = prompts
        self.echo_texts = [
            p.text if p.text is not None else tokenizer.decode(p.token_ids) for p in prompts
        ] if body.echo else None

    def choice(self, prompt_index: int, output: RequestOutput, completion: CompletionOutput, num_chars: int,
               num_tokens: int, echo: bool = True) -> CompletionChoice:
        """The choice for the completion's text from num_chars and tokens from num_tokens on, with the
        echoed prompt in front if echo (and the request asked for it)."""
        echo_text = self.echo_texts[prompt_index] if self.echo_texts is not None else ""
        prefix = echo_text if echo else ""
        logprobs = None
        if self.num_logprobs is not None:
            logprobs = CompletionLogprobs()
            if prefix:
                prompt_ids = self.prompts[prompt_index].token_ids
                self._add_logprobs(logprobs, prompt_ids, output.prompt_logprobs or [], 0)
            # NOTE: the engine appends to this list as it runs; read only the tokens this output has.
            positions = (completion.logprobs or [])[num_tokens : len(completion.token_ids)]
            offset = len(echo_text) + num_chars
            self._add_logprobs(logprobs, completion.token_ids[num_tokens:], positions, offset)
        return CompletionChoice(index=prompt_index * self.n + completion.index,
                                text=prefix + completion.text[num_chars:], logprobs=logprobs,
                                finish_reason=completion.finish_reason,
                                prompt_logprobs=prompt_logprobs(output.prompt_logprobs)
                                if self.with_prompt_logprobs else None)

    def _add_logprobs(self, logprobs: CompletionLogprobs, token_ids: list[int],
                      positions: list[PositionLogprobs | None], offset: int) -> None:
        for token_id, position in zip(token_ids, positions, strict=True):
            entry = position.get(token_id) if position else None
            token = entry.decoded_token if entry and entry.decoded_token is not None else None
            if token is None:
                token = self.tokenizer.decode([token_id], skip_special_tokens=False)
            logprobs.tokens.append(token_name(token_id, token, self.tokens_as_ids))
            logprobs.token_logprobs.append(entry.logprob if entry else None)
            top = None
            if position:  # NOTE: distinct tokens can share a text; the most likely one wins
                top = {}
                for top_id, lp in sorted(position.items(), key=_rank):
                    top.setdefault(token_name(top_id, lp.decoded_token or "", self.tokens_as_ids), lp.logprob)
            logprobs.top_logprobs.append(top)
            logprobs.text_offset.append(offset)
            offset += len(token)


def _rank(item: tuple[int, Logprob]) -> int:
    return item[1].rank or 0
