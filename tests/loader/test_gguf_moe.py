"""GGUF files of the mixture-of-experts families people download most, as llama.cpp's own tools write them:
Qwen3-MoE (qwen3moe), Qwen2-MoE (qwen2moe: a gated shared expert) and Mixtral (a llama file with stacked experts).

Float32 files run against transformers running the Hugging Face folder they were converted from (logits close,
greedy tokens equal). A file llama-quantize made Q4_0 keeps its experts in their blocks, packed for the panel
kernel expert by expert, and runs against the same file dequantized (quantization="none", the experts dequantized
by the `gguf` package): each layer's experts within the int8 rounding of their inputs, the logits close, the
greedy tokens equal, the experts' bytes about the file's.

Each conversion is a subprocess of 15-25 s on a small CPU (llama-quantize takes milliseconds): Qwen3-MoE runs by
default, the others are marked slow. The converter is told the pre-tokenizer of the tiny byte-level BPE ("qwen2";
Mixtral's: "gpt-2", whose split the tiny tokenizer uses); llama.cpp runs no dense layers in a Qwen2-MoE file, so
the tiny one has none.
"""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

import pytest
import torch

from kvforge.kernels.activation import silu_and_mul_ref
from kvforge.kernels.cpu.quant_panels import int8_rows, panels_available
from kvforge.loader.gguf_file import GGUFFile
from tests.loader.test_gguf_families import LLAMA_CPP, _generate, _greedy, _llm, convert
from tests.tiny_models import assert_logits_match, save_tokenizer

pytestmark = pytest.mark.skipif(LLAMA_CPP is None, reason="no llama.cpp checkout (set LLAMA_CPP_DIR)")
_PRE = {"qwen3_moe": "qwen2", "qwen2_moe": "qwen2", "mixtral": "gpt-2"}
_OVERRIDES = {"qwen2_moe": {"mlp_only_layers": []}}


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (30, 9, 21)]


@pytest.fixture(scope="module", params=["qwen3_moe", pytest.param("qwen2_moe", marks=pytest.mark.slow),
                                        pytest.param("mixtral", marks=pytest.mark.slow)])  # fmt: skip
def moe(request, tmp_path_factory):
    from tests.models.test_moe_vs_transformers import build_moe_model

    folder = tmp_path_factory.mktemp(request.param)
    model = build_moe_model(request.param, save_tokenizer(folder), **_OVERRIDES.get(request.param, {}))
    model.save_pretrained(folder)
    return model, convert(folder, "f32", _PRE[request.param])


def test_moe_gguf_matches_transformers(moe):
    """The router, the stacked experts (top-k renormalized or not), Qwen2-MoE's gated shared expert, Mixtral's
    llama-named file; prefill in chunks."""
    model, path = moe
    llm = _llm(path, max_num_batched_tokens=7)
    prompts = _prompts(model.config.vocab_size)
    assert_logits_match(llm, model, prompts[:2])
    assert _generate(llm, prompts) == _greedy(model, prompts)


def _quantize(path: Path, qtype: str) -> Path:
    tool = LLAMA_CPP / "build" / "bin" / "llama-quantize"
    if not tool.is_file():
        pytest.skip(f"no {tool}")
    out = path.with_name(f"model-{qtype.lower()}.gguf")
    done = subprocess.run([str(tool), str(path), str(out), qtype], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _rounded_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                 ids: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The MoE of the float experts with each product's input rounded to int8 per 32 columns, as the kernel's."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for token, slot in torch.cartesian_prod(torch.arange(ids.shape[0]), torch.arange(ids.shape[1])).tolist():
        expert = ids[token, slot]
        act = silu_and_mul_ref(int8_rows(x[token : token + 1]).double() @ w13[expert].double().t())
        out[token] += weights[token, slot] * (int8_rows(act).double() @ w2[expert].double().t())[0]
    return out


@pytest.mark.skipif(not panels_available(), reason="the panel kernel needs AVX-512 VNNI")
def test_q4_0_experts_stay_in_their_blocks(moe):
    """llama-quantize's Q4_0 file (Qwen2-MoE's shared-expert gate written as a vector, its shared down projection,
    whose rows are no multiple of 32, as F16)."""
    model, f32_path = moe
    _check_kept_experts(model, _quantize(f32_path, "Q4_0"))


@pytest.mark.slow
@pytest.mark.skipif(not panels_available(), reason="the panel kernel needs AVX-512 VNNI")
@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_hybrid_q4_0_experts_stay_in_their_blocks(tmp_path, arch):
    """Qwen3-Next's and Qwen3.5 MoE's routed experts as Qwen3-MoE's (their Gated DeltaNet layers between)."""
    from tests.tiny_models import build_hybrid_model

    # NOTE: one row more than the tokenizer's, as test_gguf_families.py's hybrid files (the converter adds one)
    vocab_size = save_tokenizer(tmp_path) + 1
    model = build_hybrid_model(arch, vocab_size, **({"mlp_only_layers": []} if arch == "qwen3_next" else {}))
    model.save_pretrained(tmp_path)
    f32_path = convert(tmp_path, "f32", "qwen2" if arch == "qwen3_next" else "qwen35", "--no-mtp")
    _check_kept_experts(model, _quantize(f32_path, "Q4_0"))


def _check_kept_experts(model, path: Path) -> None:
    """Every layer's experts are panel kernels (no float experts), their bytes about the file's; each layer's experts
    against the dequantized ones (the file with quantization="none", inputs rounded as the kernel does); the model's
    logits and greedy tokens against the dequantized model's."""
    experts_in_file = [t for t in GGUFFile(str(path)).tensors if "_exps" in t.name]
    assert {t.tensor_type.name for t in experts_in_file} == {"Q4_0"}
    kept, dense = _llm(path), _llm(path, quantization="none")
    kept_layers, dense_layers = kept.engine.runner.model.layers, dense.engine.runner.model.layers
    for layer in kept_layers:
        experts = layer.mlp.experts
        assert not hasattr(experts, "gate_up_proj") and not hasattr(experts, "down_proj")
        assert {k.name for k in [*experts.kept.gate_up, *experts.kept.down]} == {"panels"}
    kept_bytes = sum(layer.mlp.experts.kept.weight_bytes() for layer in kept_layers)
    file_bytes = sum(t.nbytes for t in experts_in_file)
    assert file_bytes <= kept_bytes <= 1.1 * file_bytes  # NOTE: the panels' padding rows
    assert kept_bytes < 0.15 * sum(int(t.n_elements) for t in experts_in_file) * 4  # float32's

    torch.manual_seed(0)
    x = torch.randn(12, model.config.hidden_size)
    ids = torch.stack([torch.randperm(kept_layers[0].mlp.experts.num_experts)[:2] for _ in range(12)])
    weights = torch.rand(12, 2)
    for ours, theirs in zip(kept_layers, dense_layers):
        reference = _rounded_moe(x, theirs.mlp.experts.gate_up_proj, theirs.mlp.experts.down_proj, weights, ids)
        torch.testing.assert_close(ours.mlp.experts(x, weights, ids).double(), reference, rtol=1e-4, atol=1e-5)

    # the panel-packed experts are one opaque op: a compiled decode step takes them whole (fullgraph), to the same
    # values
    compiled = torch.compile(kept_layers[0].mlp.experts, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x, weights, ids), kept_layers[0].mlp.experts(x, weights, ids))

    prompts = _prompts(model.config.vocab_size)
    kept_logits, dense_logits = kept.engine.score(prompts[0]), dense.engine.score(prompts[0])
    # NOTE: every layer's inputs (attention's, the LM head's too) are rounded to int8: measured 2.4% of the largest
    # logit on this random model, whose logits are all small
    assert (kept_logits - dense_logits).abs().max() <= 5e-2 * dense_logits.abs().max()
    assert _generate(kept, prompts) == _generate(dense, prompts)
