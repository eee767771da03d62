"""GGUF files of Gemma 2, Gemma 3, GPT-OSS, Qwen3-Next and Qwen3.5 (dense and MoE) as llama.cpp's own converter
writes them, run by kvforge against transformers running the Hugging Face folder they were converted from (float32:
logits close, greedy tokens equal).

Each tiny random model is built here, saved, and converted by llama.cpp's convert_hf_to_gguf.py (a subprocess; the
llama.cpp checkout is found at $LLAMA_CPP_DIR, else under ~/.cache/kvforge-peers/, else the tests skip). What the
converter changes is undone by kvforge's loader: Gemma's norms (1 + w in the file), the names and the split of
GPT-OSS's experts (gate and up apart, MXFP4 blocks in the GGUF layout), Qwen3-Next's ungrouped Gated DeltaNet
in-projection, Qwen3.5's tiled value heads, their decay (-exp(A_log)) and stacked experts, the metadata the config
comes from.

Each conversion is a subprocess of 15-25 s on a small CPU: Gemma 3 runs by default, the rest are marked slow.

NOTE: llama.cpp does not record Gemma's query_pre_attn_scalar (it takes head_dim, except for the 27B models), so the
tiny Gemma 2 has query_pre_attn_scalar = head_dim here. The converter names a byte-level BPE's pre-tokenizer by the
hash of a known model's tokens, which a tiny trained tokenizer has not: it is told the pre-tokenizer (GPT-OSS:
"gpt-4o", whose split the tiny tokenizer here uses too; Qwen3-Next: "qwen2", Qwen3.5: "qwen35").
"""

from __future__ import annotations

import glob
import io
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvforge import LLM, SamplingParams
from tests.tiny_models import (
    _CORPUS,
    assert_logits_match,
    build_hybrid_model,
    build_model,
    save_mxfp4_experts,
    save_tokenizer,
)

transformers = pytest.importorskip("transformers")


def _llama_cpp_dir() -> Path | None:
    candidates = [
        os.environ.get("LLAMA_CPP_DIR", ""),
        *sorted(glob.glob(os.path.expanduser("~/.cache/kvforge-peers/*/vendor/llama.cpp"))),
    ]
    return next((Path(c) for c in candidates if c and (Path(c) / "convert_hf_to_gguf.py").is_file()), None)


LLAMA_CPP = _llama_cpp_dir()
pytestmark = pytest.mark.skipif(LLAMA_CPP is None, reason="no llama.cpp checkout (set LLAMA_CPP_DIR)")
NUM_NEW = 8
# Runs the converter, telling it the pre-tokenizer of a byte-level BPE whose hash it does not know.
_CONVERT = """
import runpy, sys
llama_cpp, pre, *args = sys.argv[1:]
sys.path[:0] = [llama_cpp, llama_cpp + "/gguf-py"]
from conversion import base
if pre:
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = ["convert_hf_to_gguf.py", *args]
runpy.run_path(llama_cpp + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def convert(folder: Path, outtype: str = "f32", pre: str = "", *options: str) -> Path:
    out = folder / f"model-{outtype}.gguf"
    done = subprocess.run([sys.executable, "-c", _CONVERT, str(LLAMA_CPP), pre, str(folder), "--outfile", str(out),
                           "--outtype", outtype, *options], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def save_sentencepiece(folder: Path) -> int:
    """A SentencePiece BPE (as Gemma's: byte fallback, digits apart, no space prefix nor normalization) trained on a
    few lines, as tokenizer.model; returns its size."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_CORPUS), model_writer=model, model_type="bpe", vocab_size=320, byte_fallback=True,
        add_dummy_prefix=False, remove_extra_whitespaces=False, normalization_rule_name="identity", split_digits=True,
        hard_vocab_limit=False, minloglevel=2)  # fmt: skip
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    return sentencepiece.SentencePieceProcessor(model_proto=model.getvalue()).vocab_size()


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (30, 9, 21)]  # past the windows (8, 12)


def _greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    return [model.generate(torch.tensor([p]), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, do_sample=False,
                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]  # fmt: skip


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _llm(path: Path, **options) -> LLM:
    return LLM(str(path), kv_cache_memory="4MiB", kv_cache_dtype="float32", block_size=4, enforce_eager=True,
               **options)  # fmt: skip


@pytest.fixture(scope="module", params=[pytest.param("gemma2", marks=pytest.mark.slow), "gemma3"])
def gemma(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model = build_model(request.param, vocab_size=save_sentencepiece(folder), query_pre_attn_scalar=16)
    model.save_pretrained(folder)
    return folder, model, convert(folder)


def test_gemma_gguf_matches_transformers(gemma):
    """Local and global layers (windows shorter than the prompts), Gemma 3's two ropes, soft-capping, the norms."""
    folder, model, path = gemma
    llm = _llm(path, max_num_batched_tokens=7)  # prefill chunks that split the windows
    prompts = _prompts(model.config.vocab_size)
    assert_logits_match(llm, model, prompts[:2])
    assert _generate(llm, prompts) == _greedy(model, prompts)
    groups = llm.engine.kv_cache_manager.groups
    assert [g.window for g in groups[1:]] == [model.config.sliding_window] * (len(groups) - 1) and len(groups) > 1


def test_gemma_gguf_tokenizer_matches_sentencepiece(gemma):
    """The file's SentencePiece vocabulary encodes as the model it was converted from."""
    import sentencepiece

    folder, _, path = gemma
    from kvforge.loader.gguf import read_gguf_header

    tokenizer = read_gguf_header(str(path))[3]
    reference = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    for text in ["The quick brown fox", "Paris is the capital of Germany.\n  def add(a, b)", "héllo ✓ 12345"]:
        assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text), text


# o200k's split (GPT-4o, GPT-OSS), as its tokenizer.json spells it
O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """The tiny GPT-OSS twice: float experts (an F32 file) and MXFP4 experts (MXFP4 in the file, the rest F32), with
    transformers' model of each."""
    folder, mxfp4_folder = tmp_path_factory.mktemp("gpt_oss"), tmp_path_factory.mktemp("gpt_oss_mxfp4")
    model = build_model("gpt_oss", vocab_size=save_tokenizer(folder, split=O200K_SPLIT))
    model.save_pretrained(folder)
    reference = save_mxfp4_experts(mxfp4_folder, folder, model)
    return folder, model, convert(folder, pre="gpt-4o"), reference, convert(mxfp4_folder, pre="gpt-4o")


@pytest.mark.slow
def test_gpt_oss_gguf_matches_transformers(gpt_oss):
    """Sinks, biases, the router, YaRN, a window shorter than the prompts; float experts regrouped from the file's."""
    _, model, path, _, _ = gpt_oss
    llm = _llm(path, max_num_batched_tokens=7)
    prompts = _prompts(model.config.vocab_size)
    assert_logits_match(llm, model, prompts[:2])
    assert _generate(llm, prompts) == _greedy(model, prompts)


@pytest.mark.slow
def test_gpt_oss_mxfp4_gguf_keeps_its_experts(gpt_oss):
    """MXFP4 experts stay MXFP4 codes and scales (from the GGUF block layout), and run as transformers' dequantized
    model; with quantization="none" they are dequantized, to the same logits."""
    _, _, _, reference, path = gpt_oss
    llm = _llm(path)
    experts = llm.engine.runner.model.layers[0].mlp.experts
    assert experts.gate_up_proj_blocks.dtype == torch.uint8 and not hasattr(experts, "gate_up_proj")
    prompts = _prompts(reference.config.vocab_size)
    assert_logits_match(llm, reference, prompts[:1])
    assert _generate(llm, prompts) == _greedy(reference, prompts)
    dense = _llm(path, quantization="none")
    assert dense.engine.runner.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32
    assert_logits_match(dense, reference, prompts[:1])


@pytest.mark.slow
def test_gpt_oss_gguf_tokenizer_matches_transformers(gpt_oss):
    """The file's byte-level BPE with the "gpt-4o" pre-tokenizer encodes as the tokenizer.json it came from."""
    from kvforge.loader.gguf import read_gguf_header

    folder, _, path, _, _ = gpt_oss
    tokenizer = read_gguf_header(str(path))[3]
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    for text in ["The QUICK brown fox's 1234567 jumps", "Paris\n\n  is the CAPITAL of France.", "héllo ✓ we'LL"]:
        assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_hybrid_gguf_matches_transformers(tmp_path, arch):
    """Gated DeltaNet layers (their projections, conv, decay, output norm; Qwen3.5's value heads tiled in the file)
    and a gated attention layer; MoE layers with a gated shared expert (every layer's: llama.cpp's Qwen3-Next has no
    dense MLP layers) or dense MLPs (Qwen3.5); prompts over several chunks of the delta rule, prefill in chunks."""
    # NOTE: one row more than the tokenizer's: the converter reads it with Qwen's tokenizer class (Qwen3.5 MoE),
    # which adds <|endoftext|>
    vocab_size = save_tokenizer(tmp_path) + 1
    model = build_hybrid_model(arch, vocab_size, **({"mlp_only_layers": []} if arch == "qwen3_next" else {}))
    model.save_pretrained(tmp_path)
    path = convert(tmp_path, "f32", "qwen2" if arch == "qwen3_next" else "qwen35", "--no-mtp")
    llm = LLM(str(path), kv_cache_memory="16MiB", kv_cache_dtype="float32", max_num_batched_tokens=24)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, model.config.vocab_size) for _ in range(n)] for n in (70, 5, 33)]
    assert_logits_match(llm, model, prompts[:2])
    assert _generate(llm, prompts) == _greedy(model, prompts)
