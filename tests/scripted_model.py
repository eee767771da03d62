"""A tiny Llama that writes a given script: its greedy reply to a chat prompt is the script, token by token.

The model is a bigram table. Its attention and MLP outputs are zeroed, so the last hidden state is the
current token's embedding; each scripted token's embedding is its own axis, and the LM head maps that axis to
the next scripted token (logit 8, every other token 0). Other tokens embed to zero: every logit 0. Where a
grammar masks the scripted token out, or after an unscripted token, the lowest allowed token id wins the tie
(EOS, id 2, whenever the grammar allows the end). So the output is known in advance and the test sees what the engine,
the grammar and the server make of it, not what a random model happens to write.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny_models import build_model, save_tokenizer

# The tiny tokenizer's chat template, thinking tags added as tokens (as Qwen3's and DeepSeek-R1's are)
THINKING_TAGS = ["<think>", "</think>"]
GENERATION_PROMPT = "<|im_start|>assistant\n"


def save_scripted_model(folder: Path, script: str, special_tokens: tuple[str, ...] = (),
                        chat_template: str | None = None, generation_prompt: str = GENERATION_PROMPT) -> None:
    """A model and tokenizer in folder whose greedy reply to any chat prompt is script, then EOS; special_tokens are
    added to the vocabulary as such, and chat_template (ending its prompts with generation_prompt) replaces the tiny
    tokenizer's."""
    from transformers import AutoTokenizer

    save_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(THINKING_TAGS)
    tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
    prompt_end = tokenizer.encode(generation_prompt, add_special_tokens=False)[-1]
    chain = [prompt_end, *tokenizer.encode(script, add_special_tokens=False), tokenizer.eos_token_id]
    assert len(set(chain[:-1])) == len(chain) - 1, f"a scripted token repeats: {tokenizer.convert_ids_to_tokens(chain)}"
    model = build_model("llama", vocab_size=len(tokenizer), num_hidden_layers=1, max_position_embeddings=2048)
    hidden_size = model.config.hidden_size
    assert len(chain) <= hidden_size, "the script is longer than the model has axes"
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        model.model.embed_tokens.weight.zero_()  # an unscripted token: every logit 0
        model.lm_head.weight.zero_()
        for axis, (token_id, next_id) in enumerate(zip(chain, chain[1:])):
            model.model.embed_tokens.weight[token_id] = torch.nn.functional.one_hot(torch.tensor(axis), hidden_size)
            model.lm_head.weight[next_id, axis] = 1.0
    model.save_pretrained(folder)
