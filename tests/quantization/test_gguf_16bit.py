"""A GGUF file's F16 and BF16 weight matrices stay in their 16 bits (kernels/cpu/half_gemv.py multiplies them): tiny
llama files written with the `gguf` package, all F16 (tied head) and all BF16 (own head), run as the same file loaded
through the gguf package's dequantizer into float32 (`quantization="none"`), in half the bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from kvforge.kernels.cpu.half_gemv import native_bf16_gemm
from kvforge.llm import LLM
from kvforge.loader.gguf import load_gguf
from kvforge.sampling_params import SamplingParams
from tests.loader.test_gguf import (
    HEADS,
    HF_NAMES,
    HIDDEN,
    KV_HEADS,
    SHAPES,
    TOKENS,
    Stored,
    llama_cpp_permute,
    write_tiny_gguf,
)

ENGINE = dict(device="cpu", kv_cache_memory="16MiB", kv_cache_dtype="float32")
DTYPES = {Q.F16: torch.float16, Q.BF16: torch.bfloat16}
LINEAR_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def write_16bit_gguf(path: Path, qtype: Q, own_head: bool) -> None:
    rng = np.random.default_rng(int(qtype))
    tensors: dict[str, Stored] = {}

    def matrix(kind: str, gguf_name: str, hf_name: str) -> None:
        rows = rng.uniform(-0.1, 0.1, SHAPES[kind]).astype(np.float32)
        if kind in ("attn_q", "attn_k"):
            rows = llama_cpp_permute(rows, HEADS if kind == "attn_q" else KV_HEADS)
        tensors[hf_name] = Stored(gguf_name, qtype, quantize(rows, qtype), None)

    for kind in ("token_embd", "output") if own_head else ("token_embd",):
        matrix(kind, f"{kind}.weight", f"{HF_NAMES[kind]}.weight")
    norm = rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32)
    tensors["model.norm.weight"] = Stored("output_norm.weight", Q.F32, norm, norm)
    for layer in range(2):
        for kind in LINEAR_KINDS:
            matrix(kind, f"blk.{layer}.{kind}.weight", f"model.layers.{layer}.{HF_NAMES[kind]}.weight")
        for kind in ("attn_norm", "ffn_norm"):
            tensors[f"model.layers.{layer}.{HF_NAMES[kind]}.weight"] = Stored(f"blk.{layer}.{kind}.weight", Q.F32,
                                                                              norm, norm)
    write_tiny_gguf(path, "llama", tensors)


@pytest.fixture(scope="module", params=[Q.F16, Q.BF16], ids=["F16", "BF16"])
def tiny_16bit(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[Q, Path, LLM, LLM]:
    qtype = request.param
    path = tmp_path_factory.mktemp(qtype.name) / f"tiny-{qtype.name}.gguf"
    write_16bit_gguf(path, qtype, own_head=qtype == Q.BF16)
    # NOTE: the F16 engine compiled (the engine's default), the BF16 one eager, so that both step kinds run the kernels
    eager = qtype == Q.BF16
    return qtype, path, LLM(str(path), quantization="none", **ENGINE), LLM(str(path), enforce_eager=eager, **ENGINE)


def test_the_checkpoint_keeps_the_16_bit_tensors_as_stored(tiny_16bit, caplog: pytest.LogCaptureFixture) -> None:
    qtype, path, _, _ = tiny_16bit
    kept = load_gguf(str(path), torch.float32, keep_quantized=True)
    assert "no kept kernel" not in caplog.text
    matrices = {name for name in kept.tensors if name.endswith("_proj.weight") or "embed" in name or "head" in name}
    assert kept.half_dtypes == dict.fromkeys(matrices, DTYPES[qtype])
    dense = load_gguf(str(path), torch.float32)  # dequantized by the gguf package
    for name in matrices:
        tensor = kept.tensors[name]
        assert tensor.dtype == DTYPES[qtype], name
        torch.testing.assert_close(tensor.float(), dense.tensors[name], rtol=0, atol=0, msg=name)


def test_the_model_holds_its_weights_in_16_bits(tiny_16bit) -> None:
    """Every linear layer, the embedding and the head: the weight in the file's dtype, 2 bytes a weight, and no
    float32 weight matrix anywhere in the model (nor a packed copy for oneDNN)."""
    qtype, _, dense, kept = tiny_16bit
    model = kept.engine.local_model
    layer = model.layers[0]
    modules = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj,
               model.embed_tokens, model.lm_head]
    for module in modules:
        assert module.weight.dtype == DTYPES[qtype] and module.weight.element_size() == 2
        assert module.kernel.name == "float" if hasattr(module, "format") else module.kernel is None
        assert (module.kernel if hasattr(module, "format") else module).onednn_weight is None
    assert not [name for name, p in model.named_parameters() if p.dim() == 2 and p.dtype == torch.float32]
    float_bytes = sum(p.numel() * p.element_size() for p in dense.engine.local_model.parameters() if p.dim() == 2)
    assert sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 2) == float_bytes // 2


def test_logits_and_greedy_tokens_are_the_dequantized_models(tiny_16bit) -> None:
    """The weights are widened exactly and activations stay float32: the logits of a prompt (the widened GEMM) equal
    the float32 model's up to the order of the sums, and greedy decoding (the GEMV) gives the same tokens. On a CPU
    that multiplies bfloat16, a BF16 file's prompt takes its bfloat16 GEMM (activations and products rounded to
    bfloat16, half_gemv.py): its logits are within that rounding."""
    qtype, _, dense, kept = tiny_16bit
    token_ids = np.random.default_rng(1).integers(0, len(TOKENS) - 2, 40).tolist()
    dense_logits, kept_logits = dense.engine.score(token_ids), kept.engine.score(token_ids)
    rounded = qtype == Q.BF16 and native_bf16_gemm()
    assert (kept_logits - dense_logits).abs().max() <= (2e-2 if rounded else 1e-4) * dense_logits.abs().max()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    requests = [{"prompt_token_ids": token_ids[i : i + 6]} for i in range(0, 24, 6)]
    for a, b in zip(dense.generate(requests, params), kept.generate(requests, params)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
