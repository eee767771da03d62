"""Text <-> token ids, and chat templating, for a Hugging Face folder or a GGUF file.

Both sources end up as one `tokenizers.Tokenizer` (the Rust backend) plus what the backend does not
hold: the chat template, the BOS/EOS strings and the extra end-of-generation ids.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import processors

from kvforge.gguf_vocabulary import gguf_backend

logger = logging.getLogger(__name__)

@dataclass(slots=True)
class Tokenizer:
    """A byte-level BPE (or any `tokenizers`) tokenizer with its chat template and special tokens."""

    backend: tokenizers.Tokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    # End-of-generation ids beyond eos_token (generation_config.json, GGUF eot/eom ids).
    extra_eos_token_ids: tuple[int, ...] = ()
    _template: jinja2.Template | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja`,
        `generation_config.json` when present) from a Hugging Face checkpoint folder.

        As in transformers 5, tokenizer.json's post-processor alone decides whether BOS/EOS are added;
        `add_bos_token` in tokenizer_config.json is not consulted.
        """
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"{folder} has no tokenizer.json (only `tokenizers` tokenizers are supported)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # NOTE: the tokenizers library raises bare Exception
            raise ValueError(f"{tokenizer_file} could not be loaded: {e}") from e
        # NOTE: the engine bounds and batches inputs itself; a tokenizer.json may pad or cut every text to a fixed
        # length (all-MiniLM-L6-v2's pads to 128)
        backend.no_padding()
        backend.no_truncation()
        config = _read_json(folder / "tokenizer_config.json")
        bos_token = _token_content(config.get("bos_token"))
        eos_token = _token_content(config.get("eos_token"))
        template_file = folder / "chat_template.jinja"
        chat_template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        if isinstance(chat_template, list):  # [{"name": ..., "template": ...}, ...]
            chat_template = next((t["template"] for t in chat_template if t.get("name") == "default"), None)
        generation_eos = _read_json(folder / "generation_config.json").get("eos_token_id")
        extra_eos = [generation_eos] if isinstance(generation_eos, int) else list(generation_eos or ())
        return cls(backend, chat_template, bos_token, eos_token, tuple(extra_eos))

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any]) -> Tokenizer:
        """Rebuild the tokenizer a GGUF file describes in its `tokenizer.*` metadata (kvforge.loader.gguf_file):
        byte-level BPE (`tokenizer.ggml.model` "gpt2") or SentencePiece BPE ("llama"); see gguf_vocabulary.py."""
        meta = {key: value for key, value in metadata.items() if key.startswith("tokenizer.")}
        tokens: list[str] = meta.get("tokenizer.ggml.tokens", [])
        backend = gguf_backend(meta)

        def token(key: str) -> str | None:
            token_id = meta.get(f"tokenizer.ggml.{key}")
            if token_id is not None and not 0 <= token_id < len(tokens):
                raise ValueError(f"GGUF tokenizer.ggml.{key}={token_id} is outside the {len(tokens)} tokens")
            return None if token_id is None else tokens[token_id]

        bos_token, eos_token = token("bos_token_id"), token("eos_token_id")
        # NOTE: as llama.cpp, a SentencePiece vocabulary adds BOS unless the file says otherwise
        add_bos = meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama")
        add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
        backend.post_processor = _bos_eos_processor(
            backend, bos_token if add_bos else None, eos_token if add_eos else None
        )
        # NOTE: llama.cpp also ends generation on the end-of-turn and end-of-message tokens, those the file names
        # and those it finds by their text (its converter names none of Gemma's or GPT-OSS's)
        end_keys = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        named = [meta[key] for key in end_keys if key in meta]
        by_text = [token_id for token_id, text in enumerate(tokens) if text in _END_OF_TURN_TOKENS]
        extra_eos = tuple(dict.fromkeys(named + by_text))
        return cls(backend, meta.get("tokenizer.chat_template"), bos_token, eos_token, extra_eos)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.backend.token_to_id(self.eos_token)

    @property
    def eos_token_ids(self) -> set[int]:
        """Every id that ends generation: the EOS token and the model's other end markers."""
        ids = set(self.extra_eos_token_ids)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        return ids

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the special added tokens and of the BOS/EOS tokens, sorted."""
        special = {token_id for token_id, t in self.backend.get_added_tokens_decoder().items() if t.special}
        special |= {i for i in (self.bos_token_id, self.eos_token_id) if i is not None}
        return sorted(special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; with add_special_tokens, BOS/EOS only where the model asks for them."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, first: str, second: str) -> tuple[list[int], list[int]]:
        """Two texts as one input (a cross-encoder's query and document), with the model's separators: its token
        ids and their token types (0 for the first text's tokens, 1 for the second's, as the template says)."""
        encoding = self.backend.encode(first, second)
        return encoding.ids, encoding.type_ids

    def token_id(self, token: str) -> int:
        """The id of one token of the vocabulary; ValueError naming it when it is not one."""
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{token!r} is not a token of this tokenizer's vocabulary")
        return token_id

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        tokens = [self.backend.id_to_token(i) for i in ids]
        if any(t is None for t in tokens):
            raise ValueError(f"token ids out of range for a vocabulary of {self.vocab_size}: {list(ids)}")
        return tokens

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` with the model's Jinja chat template, as Hugging Face does: a message's reasoning, under
        any of the names it goes by (_REASONING_NAMES), reaches the template as reasoning_content and as thinking; an
        assistant's calls whose arguments are a JSON object's text (as the OpenAI API sends them) reach it with the
        object (as Hugging Face's templates take them: GPT-OSS's and Llama 3's write `arguments | tojson`, Qwen3.5's
        `arguments | items`).

        Extra keyword arguments (tools, enable_thinking, ...) are passed to the template.
        """
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template; pass a prompt string instead of messages")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        try:
            text = self._template.render(
                messages=[_as_templates_take_it(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template rejected these messages: {e}") from e
        return self.encode(text, add_special_tokens=False) if tokenize else text


# The end-of-turn markers of the chat formats (Gemma's, harmony's return and call, Llama 3's, ChatML's) that end a
# reply as their checkpoints' generation configs say, where a GGUF file names no end-of-turn token.
_END_OF_TURN_TOKENS = frozenset({"<end_of_turn>", "<|return|>", "<|call|>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>"})


# The names a message's reasoning goes by: reasoning_content, which Qwen's and DeepSeek's templates read (and the API
# returns), thinking, which GPT-OSS's reads (to write the analysis before a call back into the prompt), and reasoning
_REASONING_NAMES = ("reasoning_content", "thinking", "reasoning")


def _as_templates_take_it(message: dict[str, Any]) -> dict[str, Any]:
    """message with its reasoning under the names templates read and its calls' arguments as objects."""
    message = _with_reasoning_names(message)
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not isinstance(calls, list):
        return message
    return {**message, "tool_calls": [_with_argument_object(call) for call in calls]}


def _with_argument_object(call: Any) -> Any:
    """A call ({"function": {"name", "arguments"}, ...}) with arguments that are a JSON object's text as that
    object; any other call as it is (NOTE: arguments that are not JSON reach the template as the text sent)."""
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": value}} if isinstance(value, dict) else call


def _with_reasoning_names(message: dict[str, Any]) -> dict[str, Any]:
    """message with its reasoning (under the first of _REASONING_NAMES it has, not None) as reasoning_content and (if
    it has no thinking of its own) as thinking, as Hugging Face's apply_chat_template passes it."""
    reasoning = next((message[name] for name in _REASONING_NAMES if message.get(name) is not None), None)
    if reasoning is None:
        return message
    thinking = message["thinking"] if message.get("thinking") is not None else reasoning
    return {**message, "reasoning_content": reasoning, "thinking": thinking}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _token_content(token: str | dict[str, Any] | None) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ..., ...}."""
    return token.get("content") if isinstance(token, dict) else token


def _bos_eos_processor(
    backend: tokenizers.Tokenizer, bos_token: str | None, eos_token: str | None
) -> processors.TemplateProcessing:
    """Post-processor adding `bos_token` before and `eos_token` after the text (None: not added)."""
    special = [(t, backend.token_to_id(t)) for t in (bos_token, eos_token) if t is not None]
    missing = [t for t, token_id in special if token_id is None]
    if missing:
        raise ValueError(f"special tokens {missing} are not in the vocabulary")
    pieces = [f"{bos_token}:0"] if bos_token is not None else []
    pieces.append("$A:0")
    if eos_token is not None:
        pieces.append(f"{eos_token}:0")
    return processors.TemplateProcessing(single=" ".join(pieces), special_tokens=special)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    # NOTE: Hugging Face's filter keeps non-ASCII characters, unlike Jinja's built-in tojson.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: {e}") from e
