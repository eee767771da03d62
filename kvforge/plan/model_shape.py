"""What the planner needs to know of a model: its parameters grouped by how they split over devices, its
KV cache per token, and its attention FLOPs per context token.

The parameters are counted exactly, from the model class the engine would build, instantiated on the
meta device (no memory, no weights read). The model comes from an HF checkpoint folder (config.json),
a .gguf file (its metadata only), a config name shipped in `kvforge/data/configs`, or the default model.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from torch import nn

from kvforge.models.registry import resolve_model_class

_LAYER_PARAM = re.compile(r"layers\.(\d+)\.(.+)")
# NOTE: an MLP step holds gate|up (2 intermediates wide), the activated gate and its product with up (the
# reference path materializes the activation; a fused kernel does not, so this errs on the high side).
_MLP_COPIES = 4
# NOTE: matrices every tensor-parallel rank holds whole: MLA's down-projections to the latent spaces
# (as in other engines' tensor-parallel MLA) and the MoE gates, which are tiny.
_REPLICATED = ("self_attn.q_a_proj.", "self_attn.kv_a_proj_with_mqa.", "mlp.gate.", "mlp.shared_expert_gate.")


@dataclass(frozen=True, slots=True)
class LayerShape:
    """One decoder layer's parameter counts (elements, whole model = one rank) and KV cache per token."""

    sharded: int  # matrices split over tensor-parallel ranks: q, o, dense MLP, shared experts
    kv: int  # the k/v rows of the fused QKV: split like KV heads (replicated once ranks outnumber them)
    replicated: int  # matrices every rank holds whole
    experts: int  # routed experts (split over ranks); a token reads top_k of num_experts of them
    floats: int  # norms and biases: kept in the activation dtype, on every rank
    fp32: int  # parameters the engine keeps in float32 whatever the dtype (MoE router)
    buffer_bytes: int  # non-parameter tensors as the engine builds them (rotary cos/sin tables)
    kv_heads_values: int  # KV cache values per token that split with the KV heads (keys and values)
    kv_head_rows: int  # rows of head_dim among them (one scale each in an 8-bit cache)
    kv_latent_values: int  # KV cache values per token held whole by every rank (MLA latent)
    sliding_window: int | None = None  # the layer's window (it keeps the blocks of its last tokens only)
    # a linear-attention layer (hybrid models) keeps no KV cache but a state per running request: its conv state's
    # values (in the activation dtype) and its delta state's (float32), whole model = one rank
    state_values: int = 0
    state_fp32_values: int = 0


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A model's sizes for planning: per-layer groups plus the embedding, LM head and attention costs."""

    name: str
    architecture: str
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int  # 0 for latent attention (one cache row shared by every head)
    max_position: int
    tied_embeddings: bool
    final_norm: int
    global_buffer_bytes: int  # buffers outside the layers (a rotary table shared by all layers)
    layers: tuple[LayerShape, ...]
    num_experts: int  # routed experts per MoE layer, 0 for a dense model
    top_k: int  # experts per token
    attn_act_width: int  # attention intermediates per token (q, k, v, out), all heads
    mlp_act_width: int  # MLP/MoE intermediates per token, split over ranks (_MLP_COPIES per intermediate)
    moe_act_width: int  # MoE per-token copies of the hidden state that do not split (top_k gathers)
    decode_attn_flops: int  # per query token, context token and layer, all heads
    prefill_attn_flops: int  # per (query, key) pair and layer, all heads
    tp_divisors: tuple[int, ...]  # sizes a tensor-parallel split must divide (heads, intermediates)
    checkpoint_format: str  # "bf16", "fp8", "int8", "int4": how the checkpoint stores its matrices

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        layers = sum(_layer_params(layer) for layer in self.layers)
        lm_head = 0 if self.tied_embeddings else self.embedding_params
        return layers + self.embedding_params + lm_head + self.final_norm

    @property
    def active_params(self) -> int:
        """Parameters one token multiplies with (routed experts: top_k of num_experts)."""
        routed = sum(layer.experts for layer in self.layers)
        inactive = routed - routed * self.top_k // self.num_experts if self.num_experts else 0
        return self.total_params - inactive


def _layer_params(layer: LayerShape) -> int:
    return layer.sharded + layer.kv + layer.replicated + layer.experts + layer.floats + layer.fp32


def known_model_names() -> list[str]:
    """Names of the model configs shipped with kvforge (for big models no one downloads to plan)."""
    folder = resources.files("kvforge.data") / "configs"
    return sorted(entry.name.removesuffix(".json") for entry in folder.iterdir() if entry.name.endswith(".json"))


def read_model_config(model: str | None) -> tuple[str, dict]:
    """(display name, HF config dict) of a checkpoint folder, .gguf file, config.json, known name or None."""
    if model is None:
        from kvforge.loader.default_model import default_model_path

        path = Path(default_model_path())
        return path.stem, _gguf_config(path)
    if model in known_model_names():
        text = (resources.files("kvforge.data") / "configs" / f"{model}.json").read_text()
        return model, json.loads(text)
    path = Path(model)
    if path.is_dir():
        from kvforge.loader.safetensors_dir import read_hf_config

        return path.name, read_hf_config(path)
    if path.is_file() and path.suffix == ".gguf":
        return path.stem, _gguf_config(path)
    if path.is_file() and path.suffix == ".json":
        try:
            return path.stem, json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from err
    raise ValueError(
        f"model {model!r} not found: give a checkpoint folder, a .gguf file, a config.json or one of "
        f"{', '.join(known_model_names())}"
    )


def _gguf_config(path: Path) -> dict:
    """The config.json view of a GGUF file, from its metadata alone (no tensor is dequantized)."""
    from kvforge.loader.gguf import read_gguf_header

    config = read_gguf_header(str(path))[2]
    # NOTE: the engine dequantizes GGUF weights; it runs them as plain floats.
    config["torch_dtype"] = "bfloat16"
    return config


def checkpoint_format(hf_config: dict) -> str:
    """How a checkpoint stores its linear weights: fp8, int8 or int4 when quantized, else bf16."""
    quant = hf_config.get("quantization_config") or {}
    if quant.get("quant_method") == "fp8" or "float8" in str(quant.get("fmt", "")) or quant.get("fmt") == "e4m3":
        return "fp8"
    bits = quant.get("bits", quant.get("w_bit"))
    if bits in (4, 8):
        return f"int{bits}"
    return "bf16"


def build_model_shape(name: str, hf_config: dict) -> ModelShape:
    """Instantiate the engine's model class on the meta device and group its parameters."""
    model_class = resolve_model_class(hf_config)
    with torch.device("meta"):
        model = model_class(hf_config, torch.bfloat16)  # as the loader builds it: what stays float32 is meant to
    cfg = model.config
    groups = _group_parameters(model, cfg.num_layers, cfg.num_heads * cfg.head_dim)
    layer_buffers = [0] * cfg.num_layers
    global_buffers = 0
    for buffer_name, buffer in model.named_buffers():
        match = _LAYER_PARAM.match(buffer_name)
        size = buffer.numel() * buffer.element_size()
        if match:
            layer_buffers[int(match.group(1))] += size
        else:
            global_buffers += size
    layers = tuple(LayerShape(**groups[i], buffer_bytes=layer_buffers[i], **_layer_cache(model, i))
                   for i in range(cfg.num_layers))
    return ModelShape(
        name=name, architecture=type(model).__name__, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
        num_heads=cfg.num_heads, num_kv_heads=0 if "kv_lora_rank" in hf_config else cfg.num_kv_heads,
        max_position=cfg.max_position, tied_embeddings=cfg.tie_word_embeddings,
        final_norm=cfg.hidden_size, global_buffer_bytes=global_buffers, layers=layers,
        **_moe_sizes(model, hf_config), **_attention_sizes(hf_config, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
        tp_divisors=_tp_divisors(hf_config, cfg.num_heads, cfg.intermediate_size),
        checkpoint_format=checkpoint_format(hf_config),
    )


def _group_parameters(model: nn.Module, num_layers: int, q_rows: int) -> list[dict[str, int]]:
    """Per layer: element counts of the sharded, kv, replicated, experts, floats and fp32 groups."""
    groups = [dict.fromkeys(("sharded", "kv", "replicated", "experts", "floats", "fp32"), 0) for _ in range(num_layers)]
    for param_name, param in model.named_parameters():
        match = _LAYER_PARAM.match(param_name)
        if match is None:
            continue  # embedding, LM head, final norm: counted from the config
        group, rest = groups[int(match.group(1))], match.group(2)
        if param.dtype == torch.float32:
            group["fp32"] += param.numel()
        elif param.dim() == 1:
            group["floats"] += param.numel()
        elif ".experts." in f".{rest}" and "shared_experts" not in rest:
            group["experts"] += param.numel()
        elif rest.startswith(_REPLICATED):
            group["replicated"] += param.numel()
        elif rest == "self_attn.qkv_proj.weight":
            group["sharded"] += q_rows * param.shape[1]
            group["kv"] += param.numel() - q_rows * param.shape[1]
        else:
            group["sharded"] += param.numel()
    return groups


def _layer_cache(model: nn.Module, layer: int) -> dict:
    """What layer `layer` keeps: KV values per token (and its window), or a hybrid model's linear-attention state per
    request. The model's caches list its paged layers first, then its linear-attention layers' states
    (`cache_of_layer` maps a layer to its entry; every layer is paged where a model has none)."""
    spec = model.kv_cache_spec
    entry = model.cache_of_layer[layer] if hasattr(model, "cache_of_layer") else layer
    num_paged = len(spec.layer_shapes)
    if entry < num_paged:
        window = spec.layer_windows[entry] if spec.layer_windows else None
        return {**_kv_values(spec.layer_shapes[entry]), "sliding_window": window}
    conv, delta = spec.recurrent_state.layer_shapes[entry - num_paged]
    return {**_kv_values(()), "state_values": math.prod(conv), "state_fp32_values": math.prod(delta)}


def _kv_values(token_shapes: tuple[tuple[int, ...], ...]) -> dict[str, int]:
    """Split a layer's per-token cache shapes: (heads, head_dim) tensors split, 1-D latents do not."""
    heads = [shape for shape in token_shapes if len(shape) == 2]
    latent = [shape for shape in token_shapes if len(shape) == 1]
    return {
        "kv_heads_values": sum(h * d for h, d in heads),
        "kv_head_rows": sum(h for h, _ in heads),
        "kv_latent_values": sum(s[0] for s in latent),
    }


def _moe_sizes(model: nn.Module, hf_config: dict) -> dict[str, int]:
    num_experts = max((p.shape[0] for n, p in model.named_parameters() if n.endswith("experts.down_proj")),
                      default=0)  # fmt: skip
    top_k = hf_config.get("num_experts_per_tok", 0) if num_experts else 0
    hidden = hf_config["hidden_size"]
    if not num_experts:
        return {"num_experts": 0, "top_k": 0, "mlp_act_width": _MLP_COPIES * hf_config["intermediate_size"],
                "moe_act_width": 0}  # fmt: skip
    moe_inter = hf_config.get("moe_intermediate_size") or hf_config["intermediate_size"]
    shared = (hf_config.get("shared_expert_intermediate_size")
              or moe_inter * (hf_config.get("n_shared_experts") or 0))  # fmt: skip
    dense = _MLP_COPIES * hf_config["intermediate_size"] if hf_config.get("first_k_dense_replace") else 0
    routed = _MLP_COPIES * (top_k * moe_inter + shared)
    return {"num_experts": num_experts, "top_k": top_k, "mlp_act_width": max(dense, routed),
            "moe_act_width": 2 * top_k * hidden}  # fmt: skip


def _attention_sizes(hf_config: dict, num_heads: int, num_kv_heads: int, head_dim: int) -> dict[str, int]:
    if "kv_lora_rank" in hf_config:
        # decode: the absorbed form scores the cached [latent | rope key] rows and sums the latents;
        # prefill: the expanded form, per-head keys of qk_head_dim and values of v_head_dim
        latent, rope = hf_config["kv_lora_rank"], hf_config["qk_rope_head_dim"]
        qk, v = hf_config["qk_nope_head_dim"] + rope, hf_config["v_head_dim"]
        return {"attn_act_width": num_heads * (2 * qk + 2 * v),
                "decode_attn_flops": 2 * num_heads * (2 * latent + rope),
                "prefill_attn_flops": 2 * num_heads * (qk + v)}  # fmt: skip
    return {"attn_act_width": (2 * num_heads + 2 * num_kv_heads) * head_dim,
            "decode_attn_flops": 4 * num_heads * head_dim, "prefill_attn_flops": 4 * num_heads * head_dim}  # fmt: skip


def _tp_divisors(hf_config: dict, num_heads: int, intermediate_size: int) -> tuple[int, ...]:
    sizes = [num_heads, intermediate_size]
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if hf_config.get(key):
            sizes.append(hf_config[key])
    return tuple(sizes)


def load_model_shape(model: str | None) -> ModelShape:
    """The planning view of a model argument (folder, .gguf, config.json, known name or None)."""
    name, hf_config = read_model_config(model)
    return build_model_shape(name, hf_config)
