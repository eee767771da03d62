"""BERT-family bidirectional encoders (BERT, MiniLM and the sentence-transformers models built on them), and
BERT cross-encoders (BertForSequenceClassification: a query and a document read as one input, scored by a head).

An encoder runs only in pooling steps: every sequence is whole in its step and attends to all of its tokens
(layers/attention.py, no KV cache). Post-norm layers:

    x = LayerNorm(x + out(attention(x)));  x = LayerNorm(x + down(gelu(up(x))))

A pair's tokens have types: [CLS] query [SEP] are type 0, document [SEP] type 1 (the tokenizer's pair encoding).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from kvforge.layers.attention import Attention, WholeSequenceMetadata
from kvforge.layers.linear import Linear
from kvforge.layers.norm import LayerNorm
from kvforge.models.labels import num_labels

# HF hidden_act -> the activation Linear.forward_fused applies after the up projection
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


@dataclass(frozen=True, slots=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    dtype: torch.dtype = torch.float32  # of the parameters (the run dtype)

    @classmethod
    def from_hf(cls, hf: dict, dtype: torch.dtype = torch.float32) -> BertConfig:
        position_type = hf.get("position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ValueError(f"BERT position_embedding_type {position_type!r} is not supported (only 'absolute')")
        hidden_act = hf.get("hidden_act", "gelu")
        if hidden_act not in _ACTIVATIONS:
            raise ValueError(f"BERT hidden_act {hidden_act!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
        return cls(hf["vocab_size"], hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"],
                   hf["num_attention_heads"], hf.get("max_position_embeddings", 512), hf.get("type_vocab_size", 2),
                   hf.get("layer_norm_eps", 1e-12), hidden_act, dtype)


class BertEmbeddings(nn.Module):
    """Word + absolute position + token type embeddings, then LayerNorm."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype)
        self.position_embeddings = nn.Embedding(cfg.max_position, cfg.hidden_size, dtype=cfg.dtype)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size, dtype=cfg.dtype)
        self.LayerNorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=cfg.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(x, residual=self.token_type_embeddings(token_type_ids))  # [num_tokens, hidden]


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.qkv = Linear(cfg.hidden_size, [cfg.hidden_size] * 3, bias=True, dtype=cfg.dtype)
        self.attn = Attention(cfg.num_heads, cfg.num_heads, self.head_dim)
        self.attn_out = Linear(cfg.hidden_size, [cfg.hidden_size], bias=True, dtype=cfg.dtype)
        self.attn_norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=cfg.dtype)
        self.up = Linear(cfg.hidden_size, [cfg.intermediate_size], bias=True, dtype=cfg.dtype)
        self.down = Linear(cfg.intermediate_size, [cfg.hidden_size], bias=True, dtype=cfg.dtype)
        self.out_norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=cfg.dtype)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, kv_cache: None, metadata: WholeSequenceMetadata) -> torch.Tensor:
        """The biases and the activation ride in the projections (forward_fused: oneDNN post-ops on the CPU), the
        residual adds in the LayerNorms (one pass each: kernels/layer_norm.py), so a layer has no elementwise pass
        of its own.
        NOTE: the residual in the norm, not as the matmul's binary post-op: the norm reads it in the pass it makes
        anyway (measured: a MiniLM down projection and its norm 1.07x faster so)."""
        num_tokens = x.shape[0]
        q, k, v = (t.view(num_tokens, -1, self.head_dim) for t in self.qkv(x).chunk(3, dim=-1))
        attended = self.attn(q, k, v, kv_cache, metadata).reshape(num_tokens, -1)
        x = self.attn_norm(self.attn_out(attended), residual=x)
        return self.out_norm(self.down(self.up.forward_fused(x, self.act)), residual=x)


# HF name inside encoder.layer.{i} -> (our module, merged shard); LayerNorms keep their own names.
_LAYER_NAMES = {
    "attention.self.query": ("qkv", 0), "attention.self.key": ("qkv", 1), "attention.self.value": ("qkv", 2),
    "attention.output.dense": ("attn_out", 0), "intermediate.dense": ("up", 0), "output.dense": ("down", 0),
    "attention.output.LayerNorm": ("attn_norm", None), "output.LayerNorm": ("out_norm", None),
}
_LAYER_TENSOR = re.compile(r"encoder\.layer\.(\d+)\.(.+)\.(weight|bias)")
_SKIPPED = ("pooler.", "embeddings.position_ids", "cls.")  # BERT's tanh pooler and MLM head: unused by embeddings


class BertModel(nn.Module):
    """The encoder stack; forward returns the last hidden states [num_tokens, hidden] (pooled by the runner)."""

    is_causal = False
    is_pooling_only = True
    takes_token_types = True  # forward reads each token's type (0 for a single text)
    # its float32 layers may take bfloat16 products (the bf16_matmuls option): the embeddings stay within a cosine
    # of 0.9999 of float32's (all-MiniLM-L6-v2 against sentence-transformers, tests/pooling/test_embed.py)
    takes_bf16_matmuls = True

    def __init__(self, hf_config: dict, dtype: torch.dtype = torch.float32) -> None:
        """dtype: of the parameters (the run dtype)."""
        super().__init__()
        self.config = cfg = BertConfig.from_hf(hf_config, dtype)
        self.embeddings = BertEmbeddings(cfg)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[None],
                metadata: WholeSequenceMetadata, token_type_ids: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(input_ids, positions, token_type_ids)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, kv_cache, metadata)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (with or without a "bert." prefix); every parameter must be covered."""
        missing = self._load_named(weights)
        if missing:
            raise ValueError(f"checkpoint lacks tensors: {sorted(missing)[:5]}")

    def _load_named(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; the names of the parameters they left unfilled."""
        params = dict(self.named_parameters())
        missing = set(params)
        for name, tensor in weights:
            name = name.removeprefix("bert.")
            if name.startswith(_SKIPPED):
                continue
            layer = _LAYER_TENSOR.fullmatch(name)
            if layer is not None:
                index, part, param_name = layer.groups()
                if part not in _LAYER_NAMES:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in BertModel")
                module_name, shard = _LAYER_NAMES[part]
                module = self.layers[int(index)].get_submodule(module_name)
                name = f"layers.{index}.{module_name}.{param_name}"
                if shard is not None:
                    module.load_shard(param_name, shard, tensor)
                    missing.discard(name)
                    continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in BertModel")
            if params[name].shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(params[name].shape)}")
            params[name].data.copy_(tensor)
            missing.discard(name)
        return missing


class BertClassifierHead(nn.Module):
    """BERT's pooler (dense, tanh) on the CLS token's hidden state, then the classifier: [num_seqs, hidden] ->
    [num_seqs, num_labels] logits."""

    def __init__(self, hidden_size: int, num_labels: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size, dtype=dtype)
        self.out = nn.Linear(hidden_size, num_labels, dtype=dtype)

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.dense(cls_hidden)))


# HF tensor name -> BertForSequenceClassification's
_HEAD_NAMES = {"bert.pooler.dense.weight": "classifier.dense.weight", "bert.pooler.dense.bias": "classifier.dense.bias",
               "classifier.weight": "classifier.out.weight", "classifier.bias": "classifier.out.bias"}


class BertForSequenceClassification(BertModel):
    """A BERT cross-encoder (sentence-transformers' CrossEncoder, ms-marco-MiniLM-style rerankers): the encoder,
    pooled at its CLS token, then `classifier` (BertClassifierHead). One logit is a relevance score (sigmoid); more
    are class probabilities (softmax)."""

    takes_bf16_matmuls = False  # NOTE: a score's error under bfloat16 products is unmeasured against a reranker

    def __init__(self, hf_config: dict, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(hf_config, dtype)
        self.classifier = BertClassifierHead(self.config.hidden_size, num_labels(hf_config), dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The encoder's tensors as BertModel loads them; the pooler's and classifier's into the head."""
        head = dict(self.classifier.named_parameters(prefix="classifier"))

        def encoder_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name not in _HEAD_NAMES:
                    yield name, tensor
                    continue
                param = head[_HEAD_NAMES[name]]
                if param.shape != tensor.shape:
                    raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                                     f"{tuple(param.shape)}")
                param.data.copy_(tensor)
                filled.add(_HEAD_NAMES[name])

        filled: set[str] = set()
        missing = self._load_named(encoder_weights()) - filled
        if missing:
            raise ValueError(f"checkpoint lacks tensors: {sorted(missing)[:5]}")
