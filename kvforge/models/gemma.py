"""The Gemma family: Gemma 2 and Gemma 3 (text), Llama's layers rearranged.

    embeddings        scaled by sqrt(hidden_size)
    norms             RMSNorm of weight (1 + w) (the checkpoint's w; the loader adds the 1), around both halves:
                      x + post_attention_norm(attn(input_norm(x))), then x + post_feedforward_norm(mlp(pre_ff_norm(x)))
    MLP               down(gelu_tanh(gate(x)) * up(x))
    attention         scale query_pre_attn_scalar ** -0.5; local layers see a sliding window, global ones every token
                      Gemma 2: local and global alternate (layer 0 local), scores soft-capped, logits soft-capped
                      Gemma 3: five local to one global, per-head q/k RMSNorm, local layers' own rope theta

Local and global layers form separate groups of the KV cache (models/windowed.py): a local layer keeps only its
window's blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.layers.attention import AttentionMetadata
from kvforge.layers.linear import ColumnParallelLinear, RowParallelLinear
from kvforge.layers.norm import RMSNorm
from kvforge.layers.rotary import RotaryEmbedding
from kvforge.models.llama import LlamaAttention, LlamaConfig, LlamaForCausalLM
from kvforge.models.windowed import WindowedLayersMixin


class GemmaMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up in one column-parallel projection."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, dtype=cfg.dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, [cfg.hidden_size], dtype=cfg.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    """Norms before and after both the attention and the MLP; the residual adds are fused into the next norm."""

    def __init__(self, cfg: LlamaConfig, self_attn: LlamaAttention) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = GemmaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x, kv_cache, metadata))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma2ForCausalLM(WindowedLayersMixin, LlamaForCausalLM):
    """Gemma 2: local and global layers alternate; attention scores and final logits are soft-capped."""

    window_pattern = 2  # one global layer in this many (when config.json has no layer_types)

    def __init__(self, hf_config: dict, dtype: torch.dtype = torch.float32) -> None:
        """dtype: of the parameters (the run dtype)."""
        if hf_config.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"unsupported hidden_activation {hf_config['hidden_activation']!r} for Gemma")
        self.init_windows(hf_config)
        self.final_softcap = hf_config.get("final_logit_softcapping") or 0.0
        super().__init__({"tie_word_embeddings": True, **hf_config}, dtype)

    def local_rotary(self, hf_config: dict) -> RotaryEmbedding:
        """The rotary embedding of the sliding-window layers (Gemma 2: the global layers' own)."""
        return self.rotary

    def make_layer(self, hf_config: dict, layer_idx: int) -> nn.Module:
        cfg = self.config
        window = self.windows[layer_idx]
        if layer_idx == self.start_layer:
            # NOTE: one local rotary module shared by the local layers, like self.rotary by the global ones
            self.local = self.local_rotary(hf_config)
        attn = LlamaAttention(cfg, self.rotary if window is None else self.local)
        attn.attn = self.windowed_attention(
            layer_idx, attn.attn.num_heads, attn.attn.num_kv_heads,
            softcap=hf_config.get("attn_logit_softcapping") or 0.0,
            scale=hf_config.get("query_pre_attn_scalar", cfg.head_dim) ** -0.5)
        return GemmaDecoderLayer(cfg, attn)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # NOTE: the normalizer in the activations' dtype, as the checkpoint was trained
        return x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        if logits is None or not self.final_softcap:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap

    def load_tensor(self, name: str, tensor: torch.Tensor, params: set[str]) -> str:
        if name.endswith("norm.weight"):  # Gemma's norms scale by (1 + w)
            tensor = tensor.float() + 1.0
        return super().load_tensor(name, tensor, params)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 (text): five local layers to one global one, q/k RMSNorm per head, and the local layers' own rope
    theta (rope_local_base_freq), without rope scaling."""

    qk_norm = True
    window_pattern = 6

    def make_rotary(self, hf_config: dict) -> RotaryEmbedding:
        return self._rotary(hf_config, "full_attention", hf_config.get("rope_theta", 1_000_000.0),
                            hf_config.get("rope_scaling"))

    def local_rotary(self, hf_config: dict) -> RotaryEmbedding:
        return self._rotary(hf_config, "sliding_attention", hf_config.get("rope_local_base_freq", 10_000.0), None)

    def _rotary(self, hf_config: dict, layer_type: str, theta: float, scaling: dict | None) -> RotaryEmbedding:
        """The rope of one kind of layer: rope_parameters[layer_type] (newer config.json files), else theta and
        scaling as given."""
        rope = (hf_config.get("rope_parameters") or {}).get(layer_type)
        if rope is not None:
            theta, scaling = rope.get("rope_theta", theta), rope
        cfg = self.config
        return RotaryEmbedding(cfg.head_dim, cfg.max_position, theta, scaling)
