"""DeepSeek-V2 and V3: multi-head latent attention (a compressed, paged latent KV cache), the first
first_k_dense_replace layers dense, the rest mixtures of routed plus shared experts.

V2 routes by softmax, optionally limited to the best groups of experts (a group scored by its best
expert); V3 by sigmoid with a per-expert correction bias on the choice, groups scored by their two best
experts, the chosen weights renormalized. The rope is YaRN-scaled and, by default, interleaved (GPT-J
pairs); YaRN's mscale also scales the softmax.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from kvforge.layers.kv_cache_spec import KVCacheSpec
from kvforge.layers.mla import MLADims, MultiHeadLatentAttention
from kvforge.layers.moe_model import MoEModelMixin
from kvforge.layers.moe_router import RoutingConfig
from kvforge.layers.rotary import RotaryEmbedding, yarn_mscale
from kvforge.models.llama import LlamaConfig, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

_LAYER = re.compile(r"layers\.(\d+)\.")


def mla_dims(hf_config: dict, cfg: LlamaConfig) -> MLADims:
    """MLA sizes from the HF config; the softmax scale carries YaRN's mscale squared, as in DeepSeek."""
    qk_head_dim = hf_config["qk_nope_head_dim"] + hf_config["qk_rope_head_dim"]
    scale = qk_head_dim**-0.5
    rope = cfg.rope_scaling or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default" and rope.get("mscale_all_dim"):
        scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
    return MLADims(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_heads,
        q_lora_rank=hf_config.get("q_lora_rank"),
        kv_lora_rank=hf_config["kv_lora_rank"],
        qk_nope_head_dim=hf_config["qk_nope_head_dim"],
        qk_rope_head_dim=hf_config["qk_rope_head_dim"],
        v_head_dim=hf_config["v_head_dim"],
        softmax_scale=scale,
        attention_bias=hf_config.get("attention_bias", False),
    )


class DeepseekV2ForCausalLM(MoEModelMixin, LlamaForCausalLM):
    # q/k/v are not merged here (MLA); the dense and shared MLPs' gate and up are
    merged_params = {k: v for k, v in LlamaForCausalLM.merged_params.items() if v[0] == ".gate_up_proj."}
    dense_mlp_class = LlamaMLP

    @staticmethod
    def routing(hf_config: dict) -> RoutingConfig:
        grouped = hf_config.get("topk_method") == "group_limited_greedy"
        return RoutingConfig(
            num_experts=hf_config["n_routed_experts"],
            top_k=hf_config["num_experts_per_tok"],
            scoring="softmax",
            num_groups=hf_config["n_group"] if grouped else 1,
            topk_groups=hf_config["topk_group"] if grouped else 1,
            group_score="max",
            routed_scaling_factor=hf_config.get("routed_scaling_factor", 1.0),
        )

    def make_layer(self, hf_config: dict, layer_idx: int) -> nn.Module:
        dims = mla_dims(hf_config, self.config)
        attn = MultiHeadLatentAttention(dims, self.rotary, self.config.dtype)
        if layer_idx < (hf_config.get("first_k_dense_replace") or 0):
            return LlamaDecoderLayer(self.config, self.rotary, self_attn=attn)
        moe_intermediate = hf_config["moe_intermediate_size"]
        shared = moe_intermediate * (hf_config.get("n_shared_experts") or 0)
        mlp = self.moe_block(self.routing(hf_config), moe_intermediate, shared)
        return LlamaDecoderLayer(self.config, self.rotary, self_attn=attn, mlp=mlp)

    def make_rotary(self, hf_config: dict) -> RotaryEmbedding:
        """Over the qk_rope_head_dim slice of each head only, interleaved (GPT-J layout) unless the config
        says otherwise."""
        cfg = self.config
        interleaved = hf_config.get("rope_interleave", True)  # V2 has no flag: always interleaved
        return RotaryEmbedding(hf_config["qk_rope_head_dim"], cfg.max_position, cfg.rope_theta, cfg.rope_scaling,
                               is_neox=not interleaved)  # fmt: skip

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """Per token and layer, one row: the KV latent (kv_lora_rank) and the roped key (qk_rope_head_dim)."""
        dims = self.stage_layers[0].self_attn.dims
        return KVCacheSpec.latent(len(self.stage_layers), dims.cache_dim)

    def load_tensor(self, name: str, tensor: torch.Tensor, params: set[str]) -> str:
        layer = _LAYER.match(name)
        if layer and int(layer.group(1)) >= self.config.num_layers:
            return name  # the multi-token-prediction layers after the last layer: not used here
        return super().load_tensor(name, tensor, params)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    @staticmethod
    def routing(hf_config: dict) -> RoutingConfig:
        return RoutingConfig(
            num_experts=hf_config["n_routed_experts"],
            top_k=hf_config["num_experts_per_tok"],
            scoring="sigmoid",
            renormalize=hf_config.get("norm_topk_prob", True),
            num_groups=hf_config.get("n_group") or 1,
            topk_groups=hf_config.get("topk_group") or 1,
            group_score="top2_sum",
            routed_scaling_factor=hf_config.get("routed_scaling_factor", 1.0),
            correction_bias=True,
        )
