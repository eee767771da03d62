"""The hybrid Qwen family: Qwen3-Next (MoE) and Qwen3.5 (dense and MoE, the text model). Layers alternate Gated
DeltaNet linear attention (layers/gated_delta_net.py) with gated full attention, by config.layer_types (three linear
to one full by default):

    gated attention   q_proj gives per head [query, gate]; q/k RMSNorm per head; rotary on the first
                      partial_rotary_factor of each head only; out = o_proj(attention * sigmoid(gate))
    norms             the stack's RMSNorms (input, post-attention, q/k, final) scale by (1 + weight): the weight is
                      stored plus one at load, so the engine's RMSNorm runs them unchanged
    MLP               dense, or a sparse MoE block with a sigmoid-gated shared expert (Qwen2-MoE's)

The KV cache: the full-attention layers' keys and values are paged; the linear-attention layers keep a conv state and
a delta state per request slot (KVCacheSpec.recurrent_state), after the paged caches in the runner's list.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn

from kvforge.distributed.parallel_state import get_parallel_state
from kvforge.layers.attention import Attention, AttentionMetadata
from kvforge.layers.gated_delta_net import GatedDeltaNet, GatedDeltaNetConfig
from kvforge.layers.kv_cache_spec import KVCacheSpec
from kvforge.layers.linear import ColumnParallelLinear, RowParallelLinear
from kvforge.layers.moe_router import RoutingConfig
from kvforge.layers.norm import RMSNorm
from kvforge.layers.recurrent_state_spec import RecurrentStateSpec
from kvforge.layers.rotary import RotaryEmbedding
from kvforge.models.llama import LlamaConfig, LlamaDecoderLayer, LlamaMLP, local_heads
from kvforge.models.qwen_moe import Qwen2MoeForCausalLM, is_sparse_layer, num_experts

_LINEAR_ATTENTION_PARAM = re.compile(r"(layers\.\d+)\.linear_attn\.(in_proj_qkv\.weight|conv1d\.weight|A_log|dt_bias)")
_NOT_TEXT = ("model.visual.", "visual.", "mtp.")  # checkpoint tensors of parts not run
# the stack's norms that scale by (1 + weight); the Gated DeltaNet's own output norm scales by its weight
_ONE_PLUS_NORM = re.compile(r"(layers\.\d+\.(input_layernorm|post_attention_layernorm|self_attn\.[qk]_norm)|norm)"
                            r"\.weight")


class GatedAttention(nn.Module):
    """Full attention whose output is gated per channel by sigmoid(gate), the gate projected beside the query."""

    def __init__(self, cfg: LlamaConfig, rotary: RotaryEmbedding, rotary_dim: int) -> None:
        super().__init__()
        heads, kv_heads, kv_pieces = local_heads(cfg.num_heads, cfg.num_kv_heads)  # this rank's
        head_dim = cfg.head_dim
        self.q_size, self.kv_size, self.head_dim, self.rotary_dim = 2 * heads * head_dim, kv_heads * head_dim, \
            head_dim, rotary_dim  # fmt: skip
        tp = get_parallel_state()
        full_kv = cfg.num_kv_heads * head_dim
        # NOTE: per head [query, gate] rows: a rank's rows are its heads' queries and gates
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, [2 * cfg.num_heads * head_dim, full_kv, full_kv], bias=cfg.qkv_bias,
            shard_pieces=[(tp.tp_size, tp.tp_rank), kv_pieces, kv_pieces], dtype=cfg.dtype)
        self.o_proj = RowParallelLinear(cfg.num_heads * head_dim, [cfg.hidden_size], dtype=cfg.dtype)
        self.q_norm = RMSNorm(head_dim, cfg.rms_norm_eps, cfg.dtype)
        self.k_norm = RMSNorm(head_dim, cfg.rms_norm_eps, cfg.dtype)
        self.rotary = rotary
        self.attn = Attention(heads, kv_heads, head_dim)

    def _rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary on the first rotary_dim channels of each head; the rest pass through."""
        rot = self.rotary_dim
        if rot == self.head_dim:
            return self.rotary(positions, q, k)
        q_rot, k_rot = self.rotary(positions, q[..., :rot].contiguous(), k[..., :rot].contiguous())
        return torch.cat([q_rot, q[..., rot:]], dim=-1), torch.cat([k_rot, k[..., rot:]], dim=-1)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: tuple[torch.Tensor, ...],
                metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens, head_dim = x.shape[0], self.head_dim
        query_gate, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = query_gate.view(num_tokens, -1, 2 * head_dim).split([head_dim, head_dim], dim=-1)
        q = self.q_norm(q.reshape(-1, head_dim)).view(num_tokens, -1, head_dim)  # [num_tokens, heads, head_dim]
        k = self.k_norm(k.reshape(-1, head_dim)).view(num_tokens, -1, head_dim)  # [num_tokens, kv_heads, head_dim]
        q, k = self._rotate(positions, q, k)
        out = self.attn(q, k, v.reshape(num_tokens, -1, head_dim), kv_cache, metadata)
        out = out.reshape(num_tokens, -1) * torch.sigmoid(gate.reshape(num_tokens, -1))
        return self.o_proj(out)


class Qwen3NextForCausalLM(Qwen2MoeForCausalLM):
    """Qwen3-Next: grouped Gated DeltaNet in-projections (in_proj_qkvz, in_proj_ba)."""

    qkv_bias = False
    grouped_projections = True
    checkpoint_renames = {".shared_expert.": ".shared_experts.", ".linear_attn.": ".self_attn."}

    def __init__(self, hf_config: dict, dtype: torch.dtype = torch.float32) -> None:
        """dtype: of the parameters (the run dtype)."""
        hf_config = self.text_config(hf_config)
        self.linear_config = GatedDeltaNetConfig.from_hf(hf_config)
        num_layers = hf_config["num_hidden_layers"]
        self.layer_types = hf_config.get("layer_types") or [
            "full_attention" if (i + 1) % hf_config.get("full_attention_interval", 4) == 0 else "linear_attention"
            for i in range(num_layers)]  # fmt: skip
        self._check_stages(num_layers)
        super().__init__(hf_config, dtype)
        # this stage's layers (every layer without pipeline parallelism)
        stage = range(self.start_layer, self.end_layer)
        full = [i for i in stage if self.layer_types[i] == "full_attention"]
        linear = [i for i in stage if self.layer_types[i] != "full_attention"]
        # kv_caches, per stage layer: the full-attention layers' paged caches, then the linear-attention layers' states
        self.cache_of_layer = [full.index(i) if i in full else len(full) + linear.index(i) for i in stage]
        self.num_full_layers, self.num_linear_layers = len(full), len(linear)

    def _check_stages(self, num_layers: int) -> None:
        """Every pipeline stage has both kinds of layers (on every rank, so the engine's own raises the ValueError).
        NOTE: every stage's KV cache has the same groups: the engine keeps one block table per request and group."""
        state = get_parallel_state()
        for pp_rank in range(state.pp_size):
            start, end = state.layer_range(num_layers, pp_rank)
            kinds = {"full" if self.layer_types[i] == "full_attention" else "linear" for i in range(start, end)}
            if len(kinds) < 2:
                missing = ({"full", "linear"} - kinds).pop()
                raise ValueError(f"pipeline_parallel_size={state.pp_size} gives layers {start}..{end - 1} of "
                                 f"{type(self).__name__} no {missing}-attention layer; every pipeline stage needs "
                                 f"both kinds")

    @staticmethod
    def text_config(hf_config: dict) -> dict:
        """The text model's config (a multimodal checkpoint nests it under text_config); Qwen3.5 MoE names no dense
        intermediate size (its shared expert's comes from shared_expert_intermediate_size)."""
        text = {**hf_config, **hf_config["text_config"]} if "text_config" in hf_config else dict(hf_config)
        text.setdefault("intermediate_size", text.get("moe_intermediate_size"))
        return text

    def make_rotary(self, hf_config: dict) -> RotaryEmbedding:
        cfg = self.config
        rope = hf_config.get("rope_parameters") or {}
        factor = rope.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 0.25))
        self.rotary_dim = int(cfg.head_dim * factor)
        scaling = rope if rope.get("rope_type", "default") != "default" else None
        return RotaryEmbedding(self.rotary_dim, cfg.max_position, cfg.rope_theta, scaling)

    def make_layer(self, hf_config: dict, layer_idx: int) -> nn.Module:
        cfg = self.config
        if self.layer_types[layer_idx] == "full_attention":
            mixer = GatedAttention(cfg, self.rotary, self.rotary_dim)
        else:
            mixer = GatedDeltaNet(self.linear_config, self.grouped_projections, cfg.dtype)
        if not is_sparse_layer(hf_config, layer_idx):
            return LlamaDecoderLayer(cfg, self.rotary, self_attn=mixer, mlp=LlamaMLP(cfg))
        routing = RoutingConfig(num_experts=num_experts(hf_config), top_k=hf_config["num_experts_per_tok"],
                                renormalize=hf_config.get("norm_topk_prob", True))
        shared = hf_config.get("shared_expert_intermediate_size") or 0
        mlp = self.moe_block(routing, hf_config["moe_intermediate_size"], shared, shared_expert_gate=bool(shared))
        return LlamaDecoderLayer(cfg, self.rotary, self_attn=mixer, mlp=mlp)

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """Keys and values of the full-attention layers; a conv and a delta state per slot of the linear ones."""
        cfg, layers = self.config, self.stage_layers
        attention = next(layer.self_attn.attn for layer in layers if isinstance(layer.self_attn, GatedAttention))
        linear = next(layer.self_attn.cfg for layer in layers if isinstance(layer.self_attn, GatedDeltaNet))  # rank's
        states = RecurrentStateSpec.gated_delta_net(self.num_linear_layers, linear.conv_dim, linear.conv_width,
                                                    linear.num_value_heads, linear.key_head_dim, linear.value_head_dim)
        spec = KVCacheSpec.key_value(self.num_full_layers, attention.num_kv_heads, cfg.head_dim)
        return replace(spec, recurrent_state=states)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, ...]],
                metadata: AttentionMetadata, intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return super().forward(input_ids, positions, [kv_caches[i] for i in self.cache_of_layer], metadata,
                               intermediate)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The text model's tensors: a multimodal checkpoint's language model (model.language_model.*) as model.*;
        the vision tower and the multi-token-prediction layers (mtp.*) are not run, so not loaded."""
        super().load_weights((name.replace("model.language_model.", "model.", 1), tensor) for name, tensor in weights
                             if not name.startswith(_NOT_TEXT))

    def load_tensor(self, name: str, tensor: torch.Tensor, params: set[str]) -> str:
        if _ONE_PLUS_NORM.fullmatch(name):
            tensor = tensor.float() + 1.0
        if match := _LINEAR_ATTENTION_PARAM.fullmatch(name):
            layer_name = f"{match.group(1)}.self_attn"
            return f"{layer_name}.{self.get_submodule(layer_name).load_param(match.group(2), tensor)}"
        return super().load_tensor(name, tensor, params)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 (dense): separate Gated DeltaNet in-projections (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a).
    Text positions only: its multimodal rotary (mrope) is the plain rotary when every section has the same position."""

    grouped_projections = False


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5 MoE: every layer's MLP is a sparse MoE block with a gated shared expert."""
