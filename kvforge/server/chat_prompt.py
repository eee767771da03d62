"""Messages through the model's chat template into prompt token ids, for chat completions and /tokenize.

`continue_final_message` leaves the last message open, so the model goes on writing it:

    <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nThe answer is<|im_end|>\\n
                                                              cut here ┘
"""

from __future__ import annotations

from typing import Any

import jinja2

from kvforge.server.errors import APIError
from kvforge.server.serving import off_loop_if_large
from kvforge.tokenizer import Tokenizer

# Template variables that the request sets through fields of its own.
_RESERVED_KWARGS = ("messages", "add_generation_prompt", "tools", "bos_token", "eos_token")


async def chat_prompt_token_ids(tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
                                continue_final_message: bool, template_kwargs: dict[str, Any] | None,
                                tools_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The prompt's token ids; 400 naming the field for options that cannot go together or a template
    that rejects the messages. template_kwargs are the request's chat_template_kwargs, tools_kwargs the
    variables that render its tools."""
    if continue_final_message and add_generation_prompt:
        raise APIError(400, "continue_final_message continues the last message, so it needs "
                            "add_generation_prompt=false", param="continue_final_message")
    reserved = [name for name in template_kwargs or {} if name in _RESERVED_KWARGS]
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {reserved}: the request's own fields set them",
                       param="chat_template_kwargs")
    final_content = messages[-1].get("content")
    if continue_final_message and not (isinstance(final_content, str) and final_content.strip()):
        raise APIError(400, "continue_final_message needs a last message with text to continue",
                       param="continue_final_message")
    num_chars = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
    kwargs = {**(template_kwargs or {}), **(tools_kwargs or {})}
    try:
        text = await off_loop_if_large(num_chars, tokenizer.apply_chat_template, messages,
                                       add_generation_prompt=add_generation_prompt, **kwargs)
    except (ValueError, TypeError, jinja2.TemplateError) as error:  # the template rejects the messages
        raise APIError(400, f"cannot apply the chat template: {error}", param="messages") from error
    if continue_final_message:
        text = _cut_after(text, final_content)
    return await off_loop_if_large(len(text), tokenizer.encode, text, add_special_tokens=False)


def _cut_after(text: str, final_content: str) -> str:
    """text up to the end of the last message's content (or of its stripped form, if the template strips it)."""
    for content in (final_content, final_content.strip()):
        end = text.rfind(content)
        if end >= 0:
            return text[: end + len(content)]
    raise APIError(400, "continue_final_message: the chat template does not render the last message's text "
                        "as it was sent", param="continue_final_message")
