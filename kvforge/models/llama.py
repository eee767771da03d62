"""The Llama family: Llama 1/2/3, Mistral, Qwen2/2.5 (QKV bias) and Qwen3 (per-head q/k RMSNorm), and Qwen3 with
a sequence-classification head (classifiers and rerankers, run by the pooling runner)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from kvforge.distributed.parallel_state import get_parallel_state
from kvforge.kernels.ops import current_ops
from kvforge.layers.attention import Attention, AttentionMetadata
from kvforge.layers.embedding import VocabParallelEmbedding
from kvforge.layers.kv_cache_spec import KVCacheSpec
from kvforge.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from kvforge.layers.norm import RMSNorm
from kvforge.layers.rotary import RotaryEmbedding
from kvforge.models.labels import num_labels


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    dtype: torch.dtype = torch.float32  # of the parameters (the run dtype); the rope tables stay float32

    @classmethod
    def from_hf(cls, hf: dict, qkv_bias: bool = False, qk_norm: bool = False,
                dtype: torch.dtype = torch.float32) -> LlamaConfig:
        num_heads = hf["num_attention_heads"]
        rope = hf.get("rope_parameters") or {}  # newer transformers keep theta and scaling here
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
            rope_scaling=hf.get("rope_scaling") or rope or None,
            max_position=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            qkv_bias=qkv_bias or hf.get("attention_bias", False),
            qk_norm=qk_norm,
            dtype=dtype,
        )


def local_heads(num_heads: int, num_kv_heads: int) -> tuple[int, int, tuple[int, int]]:
    """This tensor-parallel rank's (query heads, KV heads, (KV pieces, KV piece index)).

    KV heads are split like the query heads when there are at least as many as ranks; with fewer,
    each KV head is replicated on tp / num_kv_heads consecutive ranks (those holding its queries)."""
    state = get_parallel_state()
    tp, rank = state.tp_size, state.tp_rank
    if num_heads % tp:
        raise ValueError(f"{num_heads} attention heads cannot be split over tensor_parallel_size={tp}")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be split or replicated over tensor_parallel_size={tp}")
    kv_pieces = (tp, rank) if num_kv_heads >= tp else (num_kv_heads, rank * num_kv_heads // tp)
    return num_heads // tp, num_kv_heads // kv_pieces[0], kv_pieces


class LlamaAttention(nn.Module):
    """Self-attention over this rank's heads: QKV column-parallel, the output projection row-parallel."""

    def __init__(self, cfg: LlamaConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        num_heads, num_kv_heads, kv_pieces = local_heads(cfg.num_heads, cfg.num_kv_heads)
        self.q_size = num_heads * cfg.head_dim
        self.kv_size = num_kv_heads * cfg.head_dim
        self.head_dim = cfg.head_dim
        tp = get_parallel_state()
        full_kv = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, [cfg.num_heads * cfg.head_dim, full_kv, full_kv], bias=cfg.qkv_bias,
            shard_pieces=[(tp.tp_size, tp.tp_rank), kv_pieces, kv_pieces], dtype=cfg.dtype)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, [cfg.hidden_size], dtype=cfg.dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.dtype) if cfg.qk_norm else None
        self.rotary = rotary  # NOTE: the model's one module, shared by every layer: one cos/sin table
        self.attn = Attention(num_heads, num_kv_heads, cfg.head_dim)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, -1, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(num_tokens, -1, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        v = v.view(num_tokens, -1, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view_as(q)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view_as(k)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v, kv_cache, metadata)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, dtype=cfg.dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, [cfg.hidden_size], dtype=cfg.dtype)
        self.ops = current_ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP with residuals; other families pass their own attention or MLP (MoE)."""

    def __init__(
        self, cfg: LlamaConfig, rotary: RotaryEmbedding, self_attn: nn.Module | None = None,
        mlp: nn.Module | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary) if self_attn is None else self_attn
        self.mlp = LlamaMLP(cfg) if mlp is None else mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, metadata)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


# Checkpoint name fragment -> (merged parameter fragment, shard index).
_MERGED = {
    ".q_proj.": (".qkv_proj.", 0), ".k_proj.": (".qkv_proj.", 1), ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
}


_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


class LlamaForCausalLM(nn.Module):
    """Decoder stack plus LM head. forward() returns hidden states; compute_logits() the logits.

    Under pipeline parallelism this rank builds only its stage's layers (the others are empty
    placeholders, so checkpoint names keep their layer index), the embedding only on the first stage
    and the norm and LM head only on the last; a stage that is not the last returns (hidden, residual)."""

    qkv_bias = False
    qk_norm = False
    merged_params = _MERGED  # checkpoint tensors stacked into one parameter
    is_causal = True  # in a pooling step (no KV cache) each token attends to those before it
    takes_token_types = False  # a pair's token types (BERT's) mean nothing to a decoder
    has_lm_head = True

    def __init__(self, hf_config: dict, dtype: torch.dtype = torch.float32) -> None:
        """dtype: of the parameters (the run dtype)."""
        super().__init__()
        cfg = LlamaConfig.from_hf(hf_config, qkv_bias=self.qkv_bias, qk_norm=self.qk_norm, dtype=dtype)
        self.config = cfg
        state = get_parallel_state()
        self.start_layer, self.end_layer = state.layer_range(cfg.num_layers)
        self.rotary = self.make_rotary(hf_config)
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
                             if state.is_first_stage else None)
        self.layers = nn.ModuleList(
            self.make_layer(hf_config, i) if self.start_layer <= i < self.end_layer else nn.Identity()
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if state.is_last_stage else None
        self.lm_head = None
        if state.is_last_stage and self.has_lm_head:
            tied_here = cfg.tie_word_embeddings and self.embed_tokens is not None
            self.lm_head = (self.embed_tokens if tied_here
                            else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype))

    def make_rotary(self, hf_config: dict) -> RotaryEmbedding:
        """The rotary embedding every layer shares (self.config is set)."""
        cfg = self.config
        return RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling)

    def make_layer(self, hf_config: dict, layer_idx: int) -> nn.Module:
        """Decoder layer layer_idx (self.config and self.rotary are set); MoE families override it."""
        return LlamaDecoderLayer(self.config, self.rotary)

    @property
    def stage_layers(self) -> nn.ModuleList:
        return self.layers[self.start_layer : self.end_layer]

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """Per token and stage layer, the paged cache keeps a key and a value of this rank's KV heads."""
        num_kv_heads = self.stage_layers[0].self_attn.attn.num_kv_heads
        return KVCacheSpec.key_value(len(self.stage_layers), num_kv_heads, self.config.head_dim)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metadata: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.embed_tokens is not None:
            x, residual = self.embed(input_ids), None  # [num_tokens, hidden]
        else:
            x, residual = intermediate  # from the previous pipeline stage
        for layer, kv_cache in zip(self.stage_layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, kv_cache, metadata)
        if self.norm is None:
            return x, residual
        x, _ = self.norm(x, residual)
        return x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input: [num_tokens, hidden]."""
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits over the whole vocabulary, [num_tokens, vocab], on the rank that samples (the
        last stage's tensor-parallel index 0); None on its tensor-parallel peers."""
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, each cut to this rank's share; every parameter must be covered."""
        # NOTE: names, not the parameters: a quantized layer drops its checkpoint tensors once its shards are in,
        # and a dict of them here kept every layer's alive until the end of the load (1 GB of a 1B model's codes)
        params = {name for name, _ in self.named_parameters()}
        missing = set(params)
        tied = self.config.tie_word_embeddings
        for name, tensor in weights:
            name = name.removeprefix("model.")
            layer = _LAYER_INDEX.match(name)
            other_stage = layer is not None and not self.start_layer <= int(layer.group(1)) < self.end_layer
            if "rotary_emb.inv_freq" in name or other_stage:
                continue
            if name in ("embed_tokens.weight", "lm_head.weight"):
                missing -= self._load_vocab(name, tensor, tied)
            elif name == "norm.weight" and self.norm is None:
                continue
            else:
                missing.discard(self.load_tensor(name, tensor, params))
        if missing:
            raise ValueError(f"checkpoint lacks tensors: {sorted(missing)[:5]}")

    def _load_vocab(self, name: str, tensor: torch.Tensor, tied: bool) -> set[str]:
        """The embedding (also the head when tied) or the head; returns the parameters filled."""
        filled = set()
        if name == "embed_tokens.weight" and self.embed_tokens is not None:
            self.embed_tokens.load(tensor)
            filled.add("embed_tokens.weight")
        if self.lm_head is not None and self.lm_head is not self.embed_tokens and (name == "lm_head.weight") != tied:
            self.lm_head.load(tensor)
            filled.add("lm_head.weight")
        return filled

    def load_tensor(self, name: str, tensor: torch.Tensor, params: set[str]) -> str:
        """Copy one checkpoint tensor (name without "model.") into place; returns the parameter filled. params: the
        names of the model's parameters before the load."""
        for fragment, (merged, shard) in self.merged_params.items():
            if fragment in name:
                layer_name, param_name = name.replace(fragment, merged).rsplit(".", 1)
                self.get_submodule(layer_name).load_shard(param_name, shard, tensor)
                return f"{layer_name}.{param_name}"
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
        module_name, param_name = name.rsplit(".", 1)
        module = self.get_submodule(module_name)
        if isinstance(module, Linear):  # cut to this rank's share, or handed to a quantization method
            module.load_shard(param_name, 0, tensor)
            return name
        param = getattr(module, param_name)
        if param.shape != tensor.shape:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(param.shape)}"
            )
        param.data.copy_(tensor)
        return name


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class Qwen3ForSequenceClassification(Qwen3ForCausalLM):
    """Qwen3 with a classifier head on the last token instead of the LM head: `score.weight` [num_labels, hidden].

    A Qwen3-Reranker-style checkpoint (a causal LM asked "yes" or "no") says `"classifier_from_token": ["no", "yes"]`
    in config.json beside this architecture: the head is then read off the LM head's rows of those tokens (the
    loader puts their ids in `classifier_from_token_ids`), as one logit, yes minus no, whose sigmoid is P(yes);
    with other than two tokens, one label per token."""

    has_lm_head = False
    is_pooling_only = True

    def __init__(self, hf_config: dict, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(hf_config, dtype)
        self.head_token_ids: list[int] | None = hf_config.get("classifier_from_token_ids")
        num_labels = self._num_labels(hf_config)
        self.score = Linear(self.config.hidden_size, [num_labels], dtype=dtype)

    def _num_labels(self, hf_config: dict) -> int:
        if self.head_token_ids is not None:
            return 1 if len(self.head_token_ids) == 2 else len(self.head_token_ids)
        return num_labels(hf_config)

    @property
    def classifier(self) -> nn.Module:
        return self.score

    def _load_vocab(self, name: str, tensor: torch.Tensor, tied: bool) -> set[str]:
        filled = super()._load_vocab(name, tensor, tied)
        if self.head_token_ids is not None and (name == "lm_head.weight") != tied:
            rows = tensor[self.head_token_ids]  # [num_tokens, hidden]
            self.score.load_shard("weight", 0, rows[1:] - rows[:1] if len(rows) == 2 else rows)
            filled.add("score.weight")
        return filled
