"""A SentencePiece BPE vocabulary in a GGUF file (tokenizer.ggml.model "llama": Llama 2, Mistral 7B, Gemma) gives the
ids SentencePiece itself gives, on a model it trains here with byte fallback: spaces, runs of spaces, line breaks,
digits, characters no piece spells (their bytes), special tokens matched whole; decoding gives the text back."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from kvforge.loader.gguf_file import GGUFFile
from kvforge.tokenizer import Tokenizer
from tests.tiny_models import _CORPUS

spm = pytest.importorskip("sentencepiece")

TEXTS = ["The quick brown fox", " leading space", "two  spaces and\nline breaks\n\n", "Paris 12345 67890",
         "naïve café – 東京 🙂", "def add(a, b):\n    return a + b", "", "x"]


def _gguf_type(processor, piece_id: int) -> gguf.TokenType:
    for check, kind in ((processor.is_unknown, gguf.TokenType.UNKNOWN), (processor.is_control, gguf.TokenType.CONTROL),
                        (processor.is_byte, gguf.TokenType.BYTE), (processor.is_unused, gguf.TokenType.UNUSED)):
        if check(piece_id):
            return kind
    return gguf.TokenType.NORMAL


@pytest.fixture(scope="module", params=[True, False], ids=["space-prefix", "no-space-prefix"])
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Tokenizer]:
    """(SentencePiece's processor, kvforge's tokenizer of the same vocabulary read from a GGUF file)."""
    folder = tmp_path_factory.mktemp("spm")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_CORPUS * 8), model_prefix=str(folder / "m"), model_type="bpe", vocab_size=400,
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=request.param, split_digits=True, character_coverage=1.0, minloglevel=2)
    processor = spm.SentencePieceProcessor(model_file=str(folder / "m.model"))
    path = folder / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    ids = range(processor.get_piece_size())
    writer.add_token_list([processor.id_to_piece(i) for i in ids])
    writer.add_token_scores([processor.get_score(i) for i in ids])
    writer.add_token_types([_gguf_type(processor, i) for i in ids])
    writer.add_bos_token_id(processor.bos_id())
    writer.add_eos_token_id(processor.eos_id())
    writer.add_add_space_prefix(request.param)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return processor, Tokenizer.from_gguf(GGUFFile(str(path)).metadata)


def test_ids_are_sentencepieces_and_decode_back(trained: tuple[object, Tokenizer]) -> None:
    processor, tokenizer = trained
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == processor.encode(text), text
        assert tokenizer.decode(ids) == processor.decode(ids) == text
    assert any(processor.is_byte(i) for i in tokenizer.encode("東京 🙂", add_special_tokens=False))


def test_bos_is_added_and_special_tokens_are_matched_whole(trained: tuple[object, Tokenizer]) -> None:
    processor, tokenizer = trained
    ids = tokenizer.encode("hi</s>there")
    assert ids == [processor.bos_id(), *processor.encode("hi"), processor.eos_id(), *processor.encode("there")]
    assert tokenizer.decode(ids) == processor.decode(ids)


def test_scores_must_match_the_tokens(tmp_path: Path) -> None:
    path = tmp_path / "no-scores.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", "\u2581hi"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match="tokenizer.ggml.scores"):
        Tokenizer.from_gguf(GGUFFile(str(path)).metadata)


def test_a_reply_ends_at_the_end_of_turn_the_file_does_not_name(tmp_path: Path) -> None:
    """Gemma's vocabulary as llama.cpp's converter writes it: EOS <eos> and no end-of-turn id, where the checkpoints'
    generation config ends generation on <eos> and <end_of_turn> (llama.cpp finds the latter by its text)."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\u2581hi"]
    path = tmp_path / "gemma-vocabulary.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([gguf.TokenType.CONTROL] * 6 + [gguf.TokenType.NORMAL])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    tokenizer = Tokenizer.from_gguf(GGUFFile(str(path)).metadata)
    assert tokenizer.eos_token_id == 1 and tokenizer.eos_token_ids == {1, tokens.index("<end_of_turn>")}
