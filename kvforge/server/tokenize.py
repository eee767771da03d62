"""POST /tokenize and /detokenize, in vLLM's shapes: a prompt (or messages through the chat template) to
token ids, and token ids back to text; GET /tokenizer_info: the special tokens and the chat template."""

from __future__ import annotations

from fastapi import APIRouter, Request

from kvforge.server.chat_prompt import chat_prompt_token_ids
from kvforge.server.errors import APIError
from kvforge.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from kvforge.server.serving import ServerState, off_loop_if_large

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest, http_request: Request) -> TokenizeResponse:
    state: ServerState = http_request.app.state.server
    state.check_model(body.model)
    tokenizer = state.engine.tokenizer
    if isinstance(body, TokenizeCompletionRequest):
        token_ids = await off_loop_if_large(len(body.prompt), tokenizer.encode, body.prompt,
                                            add_special_tokens=body.add_special_tokens)
    else:
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        token_ids = await chat_prompt_token_ids(tokenizer, messages, body.add_generation_prompt,
                                                body.continue_final_message, body.chat_template_kwargs)
    token_strs = tokenizer.convert_ids_to_tokens(token_ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(token_ids), max_model_len=state.engine.max_model_len, tokens=token_ids,
                            token_strs=token_strs)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, http_request: Request) -> DetokenizeResponse:
    state: ServerState = http_request.app.state.server
    state.check_model(body.model)
    bad = [t for t in body.tokens if t >= state.vocab_size]
    if bad:
        raise APIError(400, f"token ids must be in [0, {state.vocab_size}), got {bad[:8]}", param="tokens")
    return DetokenizeResponse(prompt=state.engine.tokenizer.decode(body.tokens))


@router.get("/tokenizer_info")
async def tokenizer_info(http_request: Request) -> TokenizerInfoResponse:
    state: ServerState = http_request.app.state.server
    tokenizer = state.engine.tokenizer
    return TokenizerInfoResponse(bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token,
                                 chat_template=tokenizer.chat_template, model_max_length=state.engine.max_model_len,
                                 vocab_size=tokenizer.vocab_size)
