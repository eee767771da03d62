"""Tokenizer against Hugging Face transformers' tokenizer for the same files.

The GGUF is the default model's (SmolLM2-135M-Instruct); the folder is what transformers saves
for it with `save_pretrained`.
"""

from __future__ import annotations

import json

import gguf
import pytest
import tokenizers
from tokenizers import pre_tokenizers, processors

from kvforge.loader.default_model import default_model_path
from kvforge.loader.gguf_file import GGUFFile
from kvforge.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see, won't we?",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { total += values[i] * 3.14f; }  // sum",
    "Call 555-0123 or +1 (800) 123 4567 before 2024-12-31: total $1,234,567.89 (x=1e-9, y=0.000001)",
    "naïve café, Straße, Ελληνικά, русский текст, 日本語のテキスト, 한국어, عربي",
    "I ❤️ 🤗 and 🇫🇷 👩‍👩‍👧‍👦!",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n4<|im_end|>\n",
    "text<|endoftext|>more<repo_name>name<file_sep>",
    "trailing spaces   \n\nand\ttabs\r\nwindows lines\n",
    "",
    "word " * 300,
]
# NOTE: the GGUF's "smollm" pre-tokenizer isolates every numeric character (\p{N}: digits, "½",
# "²", ...) before the byte-level split, as SmolLM2's own tokenizer.json and llama.cpp do.
# transformers' GGUF loader ignores "smollm", so these texts (a run of whitespace, or one space,
# before a numeral) come out differently there: "  1" is ["ĠĠ", "1"] here, ["Ġ", "Ġ", "1"] there.
NUMERALS_AFTER_SPACE = [
    "  1",
    "a\t\t3",
    "\n\n\n1. first",
    "x = [\n    1,\n    22,\n]",
    "price:  42",
    " ½ ² ⅷ",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Where is the treasure?"},
    ],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? Answer in 🇫🇷."},
    ],
]


@pytest.fixture(scope="module")
def hf_tokenizer(hf_default_tokenizer):
    return hf_default_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_gguf(GGUFFile(default_model_path()).metadata)


@pytest.fixture(scope="module")
def saved_dir(hf_tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved")
    hf_tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tokenizer, hf_tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text)
    assert tokenizer.encode(text, add_special_tokens=False) == hf_tokenizer.encode(
        text, add_special_tokens=False
    )
    assert tokenizer.convert_ids_to_tokens(ids) == hf_tokenizer.convert_ids_to_tokens(ids)


@pytest.mark.parametrize("text", TEXTS + NUMERALS_AFTER_SPACE)
def test_decode_round_trips(tokenizer, hf_tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    for skip in (True, False):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(
            ids, skip_special_tokens=skip
        )


def test_digits_are_split_like_smollm2s_own_tokenizer(tokenizer, hf_tokenizer):
    """The reference: transformers' vocabulary and merges with SmolLM2's published pre-tokenizer."""
    reference = tokenizers.Tokenizer.from_str(hf_tokenizer.backend_tokenizer.to_str())
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    for text in TEXTS + NUMERALS_AFTER_SPACE:
        assert tokenizer.encode(text) == reference.encode(text).ids, text
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("  1")) == ["ĠĠ", "1"]


def test_special_tokens_match_transformers(tokenizer, hf_tokenizer):
    assert tokenizer.bos_token_id == hf_tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_id == hf_tokenizer.eos_token_id == 2
    assert tokenizer.eos_token_ids == {2}
    assert tokenizer.vocab_size == len(hf_tokenizer) == 49152
    assert set(hf_tokenizer.all_special_ids) <= set(tokenizer.all_special_ids)
    assert tokenizer.convert_ids_to_tokens(tokenizer.all_special_ids)[:3] == [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
    ]
    with pytest.raises(ValueError, match="out of range"):
        tokenizer.convert_ids_to_tokens([49152])


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(tokenizer, hf_tokenizer, messages, add_generation_prompt):
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    expected = hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert text == expected
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == hf_tokenizer.encode(expected, add_special_tokens=False)
    assert ids.count(1) == len(messages) + (messages[0]["role"] != "system") + add_generation_prompt


# A tool call and its result as the OpenAI API sends them back: the arguments as JSON text, the reasoning before it
TOOL_TURNS = [
    {"role": "user", "content": "The weather in Paris?"},
    {"role": "assistant", "reasoning_content": "The user asks.", "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": [1, 2]}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]  # fmt: skip
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                 "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("name", ["openai-gpt-oss-120b.jinja", "Qwen3.5-4B.jinja"])
def test_templates_get_a_calls_arguments_as_an_object_and_the_reasoning_as_thinking(tokenizer, hf_tokenizer, name):
    """GPT-OSS's and Qwen3.5's templates (llama.cpp's copies) render an API-shaped tool turn as transformers renders
    it with the arguments as an object (its templates' convention): GPT-OSS's writes `arguments | tojson` and the
    analysis before the call from `thinking`, Qwen3.5's iterates `arguments | items`."""
    from tests.loader.test_gguf_families import LLAMA_CPP

    path = None if LLAMA_CPP is None else LLAMA_CPP / "models" / "templates" / name
    if path is None or not path.is_file():
        pytest.skip("no llama.cpp checkout with its model templates (set LLAMA_CPP_DIR)")
    ours = Tokenizer(tokenizer.backend, chat_template=path.read_text()).apply_chat_template(TOOL_TURNS,
                                                                                           tools=[WEATHER_TOOL])
    turns = json.loads(json.dumps(TOOL_TURNS))
    turns[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "days": [1, 2]}
    assert ours == hf_tokenizer.apply_chat_template(turns, tools=[WEATHER_TOOL], chat_template=path.read_text(),
                                                    add_generation_prompt=True, tokenize=False)
    assert "The user asks." in ours and "Paris" in ours and '\\"city' not in ours


def test_no_chat_template_gives_value_error(tokenizer):
    bare = Tokenizer(tokenizer.backend, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_can_raise(tokenizer):
    strict = Tokenizer(tokenizer.backend, chat_template="{{ raise_exception('only users here') }}")
    with pytest.raises(ValueError, match="only users here"):
        strict.apply_chat_template([{"role": "user", "content": "hi"}])


def test_from_dir_matches_transformers(saved_dir, hf_tokenizer):
    ours = Tokenizer.from_dir(saved_dir)
    for text in TEXTS + NUMERALS_AFTER_SPACE:
        ids = ours.encode(text)
        assert ids == hf_tokenizer.encode(text), text
        assert ours.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    for messages in CONVERSATIONS:
        assert ours.apply_chat_template(messages) == hf_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
    assert (ours.bos_token_id, ours.eos_token_id, ours.vocab_size) == (1, 2, 49152)


def test_from_dir_reads_every_config_form(saved_dir, tmp_path):
    """A BOS-adding post-processor, BOS as an {"content": ...} dict, the template inside
    tokenizer_config.json, and generation_config.json's list of end ids."""
    backend = tokenizers.Tokenizer.from_file(str(saved_dir / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    config = json.loads((saved_dir / "tokenizer_config.json").read_text())
    config["bos_token"] = {
        "__type": "AddedToken",
        "content": "<|im_start|>",
        "lstrip": False,
        "special": True,
    }
    config["chat_template"] = (saved_dir / "chat_template.jinja").read_text()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    ours = Tokenizer.from_dir(tmp_path)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
    assert ours.encode("hi")[0] == ours.bos_token_id == 1
    assert ours.eos_token_ids == {0, 2}
    messages = CONVERSATIONS[1]
    assert ours.apply_chat_template(messages) == reference.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )


def test_from_dir_without_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_unknown_gguf_tokenizer_model_gives_value_error(tmp_path):
    path = tmp_path / "unigram.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("t5")
    writer.add_token_list(["<unk>", "<s>", "</s>", "▁hi"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'t5'"):
        Tokenizer.from_gguf(GGUFFile(str(path)).metadata)
