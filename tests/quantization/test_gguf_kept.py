"""`quantization="gguf"`: a GGUF file's Q8_0 / Q4_0 / Q4_1 linear weights stay quantized, and the model
computes what the dequantized load computes, in less memory.

A tiny llama file mixes the kept types with others (one merged layer holds an F16 shard, so it falls
back to float; another holds 4- and 8-bit shards, each run in its own width), a Q4_K_M-like one holds Q4_K and Q6_K
shards in its merged layers, and the real default model (all Q4_1) is checked end to end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from kvforge.kernels.cpu.quant_panels import panels_available
from kvforge.kernels.ops import current_ops
from kvforge.layers.float_linear import FloatFormat
from kvforge.llm import LLM
from kvforge.loader.gguf import load_gguf
from kvforge.quantization.gguf_quants import GGUFMethod
from kvforge.quantization.quantized_weight import RowShards
from kvforge.quantization.weight_only_kernels import PanelKernel, select_kernel
from kvforge.sampling_params import SamplingParams
from tests.loader.test_gguf import (
    HEADS,
    HF_NAMES,
    HIDDEN,
    KV_HEADS,
    QUANTIZABLE,
    SHAPES,
    TOKENS,
    Stored,
    llama_cpp_permute,
    random_blocks,
    write_tiny_gguf,
)

# q/k/v in three kept types (an 8-bit merged layer), gate_up with an F16 shard (float), the rest kept.
PLAN = {"token_embd": Q.Q8_0, "output": Q.Q4_0, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0,
        "attn_output": Q.Q4_1, "ffn_gate": Q.Q4_0, "ffn_up": Q.F16, "ffn_down": Q.Q8_0}  # fmt: skip
# dtype auto (float32 on the CPU: an explicit one dequantizes); a float32 cache, so that the weights alone differ
ENGINE = dict(device="cpu", kv_cache_memory="16MiB", kv_cache_dtype="float32")


# As a Q4_K_M file's layers: v and up in 6 bits (Q6_K) beside q, k and gate in 4 (Q4_K), each merged layer's shards
# in two widths; random blocks (the gguf package quantizes no K-quant).
MIXED_PLAN = {"token_embd": Q.Q8_0, "output": Q.Q4_0, "attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K,
              "attn_output": Q.Q4_K, "ffn_gate": Q.Q4_K, "ffn_up": Q.Q6_K, "ffn_down": Q.Q6_K}  # fmt: skip


def plan_tensors(rng: np.random.Generator, plan: dict[str, Q] = PLAN) -> dict[str, Stored]:
    tensors: dict[str, Stored] = {}

    def matrix(kind: str, gguf_name: str, hf_name: str) -> None:
        qtype = plan[kind]
        if qtype not in QUANTIZABLE:
            tensors[hf_name] = Stored(gguf_name, qtype, random_blocks(rng, qtype, SHAPES[kind]), None)
            return
        rows = rng.uniform(-0.1, 0.1, SHAPES[kind]).astype(np.float32)
        if kind in ("attn_q", "attn_k"):
            rows = llama_cpp_permute(rows, HEADS if kind == "attn_q" else KV_HEADS)
        tensors[hf_name] = Stored(gguf_name, qtype, quantize(rows, qtype), None)

    for kind in ("token_embd", "output"):
        matrix(kind, f"{kind}.weight", f"{HF_NAMES[kind]}.weight")
    ones = np.ones(HIDDEN, dtype=np.float32)
    tensors["model.norm.weight"] = Stored("output_norm.weight", Q.F32, ones, ones)
    for layer in range(2):
        for kind in [k for k in plan if k not in ("token_embd", "output")]:
            matrix(kind, f"blk.{layer}.{kind}.weight", f"model.layers.{layer}.{HF_NAMES[kind]}.weight")
        for kind in ("attn_norm", "ffn_norm"):
            name = f"model.layers.{layer}.{HF_NAMES[kind]}.weight"
            tensors[name] = Stored(f"blk.{layer}.{kind}.weight", Q.F32, ones, ones)
    return tensors


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("kept") / "tiny-llama.gguf"
    write_tiny_gguf(path, "llama", plan_tensors(np.random.default_rng(0)))
    return path


def test_kept_tensors_are_the_dequantized_ones(tiny_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Kept: the linear weights, the embedding and the LM head of kept types, rows in HF order (q/k
    un-permuted like the float load); the F16 ones stay in 16 bits (tests/quantization/test_gguf_16bit.py)."""
    dense = load_gguf(str(tiny_path), torch.float32)
    kept = load_gguf(str(tiny_path), torch.float32, keep_quantized=True)
    assert "no kept kernel" not in caplog.text
    kinds = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj", "embed_tokens", "lm_head"}
    assert sorted(kept.quantized) == sorted(n for n in dense.tensors if n.split(".")[-2] in kinds)
    assert sorted(kept.tensors) == sorted(set(dense.tensors) - set(kept.quantized))
    up = sorted(name for name in dense.tensors if name.endswith("up_proj.weight"))
    assert kept.half_dtypes == dict.fromkeys(up, torch.float16)
    for name, weight in kept.quantized.items():
        torch.testing.assert_close(weight.dequantize(), dense.tensors[name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.fixture(scope="module")
def tiny_llms(tiny_path: Path) -> tuple[LLM, LLM]:
    return LLM(str(tiny_path), quantization="none", **ENGINE), LLM(str(tiny_path), **ENGINE)


def test_layers_get_the_kept_bits(tiny_llms: tuple[LLM, LLM]) -> None:
    layer = tiny_llms[1].engine.local_model.layers[0]
    methods = {
        name: module.format
        for name, module in [("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj),
                             ("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj)]
    }  # fmt: skip
    assert {k: m.bits for k, m in methods.items() if isinstance(m, GGUFMethod)} == {"qkv": 8, "o": 4, "down": 8}
    assert isinstance(methods["gate_up"], FloatFormat)  # an F16 shard: the layer stays float
    assert layer.mlp.gate_up_proj.weight.dtype == torch.float32  # its F16 shard widened too (with a warning)


def test_a_gguf_type_is_kept_by_its_one_block_layout_entry(
    tiny_path: Path, tiny_llms: tuple[LLM, LLM], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Which GGUF types stay quantized is one table, BLOCK_LAYOUTS (a type's layout and decoder): without Q4_1's
    entry, the layers with a Q4_1 shard (o, and qkv through k) load float and say so; nothing else changes."""
    from kvforge.quantization.gguf_blocks import BLOCK_LAYOUTS

    monkeypatch.delitem(BLOCK_LAYOUTS, Q.Q4_1)
    without = LLM(str(tiny_path), **ENGINE).engine.local_model.layers[0]
    assert "type Q4_1 (" in caplog.text and "have no kept kernel" in caplog.text
    assert [without.self_attn.qkv_proj.kernel.name, without.self_attn.o_proj.kernel.name] == ["float", "float"]
    assert isinstance(without.mlp.down_proj.format, GGUFMethod)  # Q8_0 has its entry
    with_entry = tiny_llms[1].engine.local_model.layers[0]
    assert isinstance(with_entry.self_attn.o_proj.format, GGUFMethod) and with_entry.self_attn.o_proj.format.bits == 4


def test_tiny_model_logits_and_tokens_match_the_dequantized_load(tiny_llms: tuple[LLM, LLM]) -> None:
    dense, kept = tiny_llms
    token_ids = np.random.default_rng(1).integers(0, len(TOKENS) - 2, 40).tolist()
    dense_logits, kept_logits = dense.engine.score(token_ids), kept.engine.score(token_ids)
    # NOTE: where the C++ CPU kernels are not built, the 4-bit o_proj runs on int4pack, which rounds
    # activations to bfloat16; hence a tolerance.
    bound = 2e-2 * dense_logits.abs().max()
    assert (kept_logits - dense_logits).abs().max() <= bound
    # Greedy answers through prefill and decode steps: the same tokens until they part, and where they part the float
    # model itself was within the bound of choosing the kept model's token (every CPU kernel path rounds activations:
    # to int8, or to bfloat16 without the C++ kernels, so a near tie of this random model may fall either way).
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [token_ids[i : i + 6] for i in range(0, 24, 6)]
    requests = [{"prompt_token_ids": prompt} for prompt in prompts]
    for prompt, a, b in zip(prompts, dense.generate(requests, params), kept.generate(requests, params)):
        ours, theirs = a.outputs[0].token_ids, b.outputs[0].token_ids
        parted = next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), None)
        if parted is not None:
            logits = dense.engine.score(prompt + ours[:parted])[-1]
            assert logits[ours[parted]] - logits[theirs[parted]] <= 2 * bound, (prompt, ours, theirs)


def test_merged_layers_of_mixed_types_keep_each_shard_in_its_own(tmp_path: Path) -> None:
    """A Q4_K_M-like file (q, k, gate Q4_K; v, up Q6_K): the merged layers run a kernel per width, reading what their
    shards read as layers of their own, and the model computes what the dequantized load computes."""
    path = tmp_path / "mixed.gguf"
    write_tiny_gguf(path, "llama", plan_tensors(np.random.default_rng(2), MIXED_PLAN))
    dense, kept = LLM(str(path), quantization="none", **ENGINE), LLM(str(path), **ENGINE)
    weights = {name.removeprefix("model.layers.0.").removesuffix(".weight"): weight for name, weight
               in load_gguf(str(path), torch.float32, keep_quantized=True).quantized.items()}  # fmt: skip
    q, k = weights["self_attn.q_proj"], weights["self_attn.k_proj"]
    layer = kept.engine.local_model.layers[0]
    # the bytes of the file's tensors as layers of their own (q and k stacked: one 4-bit layer of their rows)
    for merged, own in [(layer.self_attn.qkv_proj, [RowShards([q, k], 4, 32), weights["self_attn.v_proj"]]),
                        (layer.mlp.gate_up_proj, [weights["mlp.gate_proj"], weights["mlp.up_proj"]])]:
        own_bytes = sum(select_kernel(w, torch.device("cpu"), torch.float32, current_ops()).weight_bytes() for w in own)
        assert len(merged.kernel.runs) == 2 and merged.kernel.weight_bytes() == own_bytes
    token_ids = np.random.default_rng(3).integers(0, len(TOKENS) - 2, 24).tolist()
    dense_logits, kept_logits = dense.engine.score(token_ids), kept.engine.score(token_ids)
    # NOTE: the panel kernel rounds x to int8 in the prompt too, per 32 columns (Q4_0, Q8_0) or per 256 (the
    # K-quants' super-blocks, as llama.cpp rounds x for them). Measured, the largest error of a position as a part of
    # the largest logit: 5.9% at the 90th percentile of the 24 positions (3.3% with the K-quants' x rounded per 32),
    # and 52% at one (14), where this random model's attention is near a tie (q and k 0.4% off move its attention
    # output by 130%): nine positions in ten are held to the bound.
    tolerance = 6e-2 if layer.mlp.down_proj.kernel.name == "panels" else 2e-2
    errors = (kept_logits - dense_logits).abs().amax(dim=-1)
    assert errors.quantile(0.9) <= tolerance * dense_logits.abs().max(), errors
    assert (kept_logits.argmax(-1) == dense_logits.argmax(-1)).float().mean() >= 0.9


def test_gguf_option_needs_a_gguf_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')  # a checkpoint folder
    with pytest.raises(ValueError, match="quantization='gguf'.*is a folder"):
        LLM(str(tmp_path), quantization="gguf", **ENGINE)


def weight_bytes(llm: LLM) -> int:
    model = llm.engine.local_model
    tensors = [*model.parameters(), *(b for b in model.buffers() if b is not None)]
    return sum(t.numel() * t.element_size() for t in tensors)


def test_default_model_kept_quantized_answers_the_same_in_less_memory() -> None:
    dense = LLM(quantization="none", **ENGINE)
    kept = LLM(**ENGINE)  # a GGUF file keeps its blocks by default
    model = kept.engine.local_model
    assert all(isinstance(layer.mlp.down_proj.format, GGUFMethod) for layer in model.layers)
    # the linear layers go from 465 MiB of float32 to ~1.1 bytes per weight
    assert weight_bytes(kept) < 0.45 * weight_bytes(dense)
    text = "The lighthouse keeper climbed the stairs every evening to light the lamp before the ships came."
    token_ids = dense.get_tokenizer().encode(text)
    dense_logits, kept_logits = dense.engine.score(token_ids), kept.engine.score(token_ids)
    # the same weights: float32 rounding apart, unless int4pack rounds activations to bfloat16 or the panel kernel
    # (AVX-512 VNNI) rounds them to int8 per 32 columns in the prompt too (as llama.cpp does): measured 3.4% there
    kernel = model.layers[0].mlp.down_proj.kernel.name
    tolerance = {"int4pack": 3e-2, "panels": 6e-2}.get(kernel, 1e-4)
    assert (kept_logits - dense_logits).abs().max() <= tolerance * dense_logits.abs().max()
    # NOTE: the panel kernel flips one of the 17 greedy tokens (a near tie); mean perplexity over the shipped texts
    # 15.233 -> 15.242 (+0.06%) with it against the AVX2 kernels, `kvforge eval perplexity --quantization gguf`
    assert (kept_logits.argmax(-1) == dense_logits.argmax(-1)).float().mean() >= (0.9 if kernel == "panels" else 0.95)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    dense_answer, kept_answer = (llm.chat(question, params)[0].outputs[0].text for llm in (dense, kept))
    assert dense_answer.startswith("The capital of France is Paris")
    # NOTE: the first token is a near tie in float32 ("The" 25.33, "L" 25.24), which rounding activations to int8
    # per 32 columns (as llama.cpp does) tips either way. llama.cpp's answer on this file: llama-server -m <the file>
    # -t 2, then /v1/chat/completions with this question, temperature 0, 16 tokens -> "L'Étoile, la Marseillaise,
    # la femme au". Measured here: the AVX2 GEMV (int8 activations in decode) "L'Étoile, la Marseillaise, la femme";
    # the AVX-512 VNNI panel kernel (int8 activations in the prompt too) "L'Étoile, la Cité, la Nation"; float
    # activations (no C++ kernels) the dense answer.
    expected = {"native": ("L'Étoile, la Marseillaise, la femme",), "panels": ("L'Étoile, la", dense_answer)}
    assert kept_answer.startswith(expected.get(kernel, (dense_answer,)))


def test_vocabulary_tensors_stay_quantized_unless_switched_off(tiny_path: Path, tiny_llms: tuple[LLM, LLM]) -> None:
    """The file's Q8_0 embedding and Q4_0 head stay in their blocks (the head through the GEMV); switched off,
    both are float again and the logits are the same up to float32 rounding (of x rounded to int8 where the head runs
    on the panel kernel)."""
    kept = tiny_llms[1].engine.local_model
    assert kept.embed_tokens.kernel.bits == 8 and kept.lm_head.kernel.bits == 4
    assert not hasattr(kept.embed_tokens, "weight") and not hasattr(kept.lm_head, "weight")
    float_vocab = LLM(str(tiny_path), quantization="gguf", quantize_lm_head=False, **ENGINE)
    model = float_vocab.engine.local_model
    assert model.embed_tokens.kernel is None and model.lm_head.kernel is None
    token_ids = list(range(3, 40))
    kept_logits, float_logits = tiny_llms[1].engine.score(token_ids), float_vocab.engine.score(token_ids)
    if kept.lm_head.kernel.name == "panels":  # it rounds the head's input to int8 per 32 columns (AVX-512 VNNI)
        assert (kept_logits - float_logits).abs().max() <= 2e-2 * float_logits.abs().max()
    else:
        torch.testing.assert_close(kept_logits, float_logits, rtol=1e-4, atol=1e-4)


def test_rtn_quantizes_the_vocabulary_rows_to_int8(tiny_llama_dir) -> None:
    folder = str(tiny_llama_dir[0])
    quantized = LLM(folder, quantization="w8a16", **ENGINE)
    float_head = LLM(folder, quantization="w8a16", quantize_lm_head=False, **ENGINE)
    model = quantized.engine.local_model
    assert model.embed_tokens.kernel.bits == 8 and model.lm_head.kernel.bits == 8
    assert float_head.engine.local_model.lm_head.kernel is None
    token_ids = list(range(3, 60))
    ours, reference = quantized.engine.score(token_ids), float_head.engine.score(token_ids)
    assert (ours - reference).abs().max() <= 2e-2 * reference.abs().max()
    assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9


@pytest.mark.skipif(not panels_available(), reason="the panel kernels need AVX-512 VNNI")
def test_compiled_single_stream_steps_read_the_kept_weights_interleaved_and_answer_as_eager(tiny_path: Path) -> None:
    """The panel weights lie in one arena, part t of each in region t, the vocabulary's first (the embedding, then
    the LM head, which a step reads last: the next step's layers run on from it), then the layers' in module order
    (the order the step multiplies by them); the compiled single-stream step calls them from Inductor's C++ wrapper
    and answers as eager."""
    options = dict(ENGINE, quantization="gguf", compile_buckets=(1,))
    compiled = LLM(str(tiny_path), **options)
    compiled.engine.runner.decode_graphs.compile_ahead(1)
    eager = LLM(str(tiny_path), enforce_eager=True, **options)
    kernels = [(name, module) for name, module in compiled.engine.local_model.named_modules()
               if isinstance(module, PanelKernel)]  # fmt: skip
    weights = [module.weight for _, module in kernels]
    region = weights[0].stride(0)
    assert {weight.untyped_storage().data_ptr() for weight in weights} == {weights[0].untyped_storage().data_ptr()}
    assert all(weight.stride(0) == region for weight in weights)
    in_arena = sorted(zip(weights, (name.removesuffix(".kernel") for name, _ in kernels)),
                      key=lambda pair: pair[0].data_ptr())
    assert in_arena[-1][0][0].data_ptr() + in_arena[-1][0][0].nbytes <= in_arena[0][0].data_ptr() + region
    # gate_up stays float (an F16 shard); qkv runs q and k (Q4_0, Q4_1) in 4-bit panels, v (Q8_0) in 8-bit ones
    layer = ["self_attn.qkv_proj.kernel.runs.0", "self_attn.qkv_proj.kernel.runs.1", "self_attn.o_proj",
             "mlp.down_proj"]
    assert [name for _, name in in_arena] == [
        "embed_tokens", "lm_head", *(f"layers.{i}.{name}" for i in range(2) for name in layer)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(5, 17))}]
    answers = [llm.generate(prompt, params)[0].outputs[0].token_ids for llm in (compiled, eager)]
    assert answers[0] == answers[1]
    assert compiled.engine.runner.decode_graphs.wrappers == {1: "C++"}
