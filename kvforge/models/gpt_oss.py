"""GPT-OSS: Llama's pre-norm stack with

    attention   biases on q, k, v and o; a learned sink logit per head in the softmax; sliding-window (128) and full
                layers alternating (layer 0 local); YaRN rope
    MLP         a mixture of experts: the router is a linear layer with a bias, top_k of its logits, softmax over
                those; every expert is a clamped SwiGLU with biases (kernels/mxfp4_moe.py), gate and up rows
                interleaved in gate_up_proj

The experts are kept as the checkpoint ships them: float (bf16 / fp32 checkpoints: `experts.gate_up_proj` [experts,
hidden, 2 * inter], `experts.down_proj` [experts, inter, hidden], stored transposed here) or MXFP4 (checkpoints with
`"quantization_config": {"quant_method": "mxfp4"}`: `experts.gate_up_proj_blocks` / `_scales` and
`experts.down_proj_blocks` / `_scales`, kept as codes and scales; kernels/mxfp4.py pictures the layout).

Tensor parallel: heads as in Llama (the sinks of this rank's heads); every expert's intermediate dim is sliced (rank r
keeps gate/up row pairs and down columns [r * I / n, (r + 1) * I / n)), whole MXFP4 blocks of 32 at a time.
"""

from __future__ import annotations

import torch
from torch import nn

from kvforge.distributed.parallel_state import get_parallel_state
from kvforge.kernels.mxfp4 import BLOCK_SIZE
from kvforge.kernels.mxfp4_moe import biased_moe
from kvforge.kernels.ops import current_ops
from kvforge.layers.linear import RowParallelLinear
from kvforge.layers.moe import SparseMoeBlock
from kvforge.layers.moe_router import Router, RoutingConfig
from kvforge.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from kvforge.models.windowed import WindowedLayersMixin


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class GptOssExperts(nn.Module):
    """The routed experts of one layer, this rank's share of the intermediate dim (inter = I / tp), named as in the
    checkpoints: gate_up_proj [experts, 2 * inter, hidden] (gate and up rows interleaved; the checkpoint's transposed)
    and down_proj [experts, hidden, inter] in float, or as MXFP4 gate_up_proj_blocks [experts, 2 * inter, hidden / 32,
    16], gate_up_proj_scales [experts, 2 * inter, hidden / 32], down_proj_blocks [experts, hidden, inter / 32, 16] and
    down_proj_scales; biases gate_up_proj_bias [experts, 2 * inter] and down_proj_bias [experts, hidden] in fp32
    (down_proj_bias only on rank 0: the ranks' outputs are summed)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, alpha: float, limit: float,
                 mxfp4: bool, dtype: torch.dtype = torch.float32) -> None:  # fmt: skip
        """dtype: of the float experts (the run dtype)."""
        super().__init__()
        state = get_parallel_state()
        self.tp_size, self.tp_rank = state.tp_size, state.tp_rank
        inter = intermediate_size // self.tp_size
        if intermediate_size % self.tp_size or (mxfp4 and (inter % BLOCK_SIZE or hidden_size % BLOCK_SIZE)):
            raise ValueError(f"GPT-OSS experts of intermediate_size {intermediate_size} and hidden_size {hidden_size} "
                             f"cannot be split over tensor_parallel_size={self.tp_size}"
                             + (f" in MXFP4 blocks of {BLOCK_SIZE}" if mxfp4 else ""))  # fmt: skip
        self.num_experts, self.inter, self.alpha, self.limit, self.mxfp4 = num_experts, inter, alpha, limit, mxfp4
        self.ops = current_ops()
        if mxfp4:
            self.gate_up_proj_blocks = _param(num_experts, 2 * inter, hidden_size // BLOCK_SIZE, 16, dtype=torch.uint8)
            self.gate_up_proj_scales = _param(num_experts, 2 * inter, hidden_size // BLOCK_SIZE, dtype=torch.uint8)
            self.down_proj_blocks = _param(num_experts, hidden_size, inter // BLOCK_SIZE, 16, dtype=torch.uint8)
            self.down_proj_scales = _param(num_experts, hidden_size, inter // BLOCK_SIZE, dtype=torch.uint8)
        else:
            self.gate_up_proj = _param(num_experts, 2 * inter, hidden_size, dtype=dtype)
            self.down_proj = _param(num_experts, hidden_size, inter, dtype=dtype)
        self.gate_up_proj_bias = _param(num_experts, 2 * inter, dtype=torch.float32)
        self.down_proj_bias = _param(num_experts, hidden_size, dtype=torch.float32)

    def load(self, name: str, tensor: torch.Tensor) -> str:
        """A checkpoint tensor of the experts (name: gate_up_proj, down_proj, their _bias, _blocks or _scales), cut to
        this rank's share; returns the parameter filled."""
        rows = slice(2 * self.inter * self.tp_rank, 2 * self.inter * (self.tp_rank + 1))  # gate/up row pairs
        cols = slice(self.inter * self.tp_rank, self.inter * (self.tp_rank + 1))
        groups = slice(cols.start // BLOCK_SIZE, cols.stop // BLOCK_SIZE)
        pieces = {  # this rank's piece of each checkpoint tensor, in the parameter's layout
            "gate_up_proj": lambda t: t.transpose(1, 2)[:, rows],
            "down_proj": lambda t: t.transpose(1, 2)[:, :, cols],
            "gate_up_proj_bias": lambda t: t[:, rows],
            "down_proj_bias": lambda t: t if self.tp_rank == 0 else torch.zeros_like(t),
            "gate_up_proj_blocks": lambda t: t[:, rows],
            "gate_up_proj_scales": lambda t: t[:, rows],
            "down_proj_blocks": lambda t: t[:, :, groups],
            "down_proj_scales": lambda t: t[:, :, groups],
        }
        param = getattr(self, name, None) if name in pieces else None
        if not isinstance(param, nn.Parameter):
            kind = "MXFP4" if self.mxfp4 else "float"
            raise ValueError(f"checkpoint tensor experts.{name!r} has no place in GPT-OSS's {kind} experts")
        tensor = pieces[name](tensor)
        if param.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor experts.{name} has shape {tuple(tensor.shape)} here, expected "
                             f"{tuple(param.shape)}")  # fmt: skip
        param.data.copy_(tensor)
        return name

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, hidden] -> this rank's share of the experts' weighted sum, [num_tokens, hidden]."""
        if self.mxfp4:
            return self.ops.mxfp4_moe(
                x,
                self.gate_up_proj_blocks,
                self.gate_up_proj_scales,
                self.gate_up_proj_bias,
                self.down_proj_blocks,
                self.down_proj_scales,
                self.down_proj_bias,
                topk_weights,
                topk_ids,
                self.alpha,
                self.limit,
            )
        weights_of = lambda ids: (self.gate_up_proj[ids], self.down_proj[ids])  # noqa: E731
        return biased_moe(x, weights_of, self.num_experts, self.gate_up_proj_bias, self.down_proj_bias, topk_weights,
                          topk_ids, self.alpha, self.limit)  # fmt: skip


def is_mxfp4(hf_config: dict) -> bool:
    return (hf_config.get("quantization_config") or {}).get("quant_method") == "mxfp4"


class GptOssForCausalLM(WindowedLayersMixin, LlamaForCausalLM):
    """GPT-OSS (the module docstring): Llama's stack, every layer's attention biased, windowed or full, with sinks,
    and every MLP GPT-OSS's experts behind a biased router."""

    qkv_bias = True

    def __init__(self, hf_config: dict, dtype: torch.dtype = torch.float32) -> None:
        """dtype: of the parameters (the run dtype; the router, biases and sinks stay float32)."""
        self.init_windows(hf_config)
        super().__init__(hf_config, dtype)

    def make_layer(self, hf_config: dict, layer_idx: int) -> nn.Module:
        cfg = self.config
        attn = LlamaAttention(cfg, self.rotary)
        attn.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, [cfg.hidden_size], bias=True, dtype=cfg.dtype)
        attn.attn = self.windowed_attention(layer_idx, attn.attn.num_heads, attn.attn.num_kv_heads, use_sinks=True)
        num_experts = hf_config["num_local_experts"]
        routing = RoutingConfig(num_experts=num_experts, top_k=hf_config["num_experts_per_tok"], renormalize=True,
                                logit_bias=True)  # fmt: skip
        experts = GptOssExperts(num_experts, cfg.hidden_size, cfg.intermediate_size,
                                hf_config.get("swiglu_alpha", 1.702), hf_config.get("swiglu_limit", 7.0),
                                is_mxfp4(hf_config), cfg.dtype)  # fmt: skip
        return LlamaDecoderLayer(
            cfg, self.rotary, self_attn=attn, mlp=SparseMoeBlock(Router(cfg.hidden_size, routing), experts)
        )

    def load_tensor(self, name: str, tensor: torch.Tensor, params: set[str]) -> str:
        name = name.replace(".mlp.router.", ".mlp.gate.")
        if ".mlp.experts." in name:
            module_name, param_name = name.split(".mlp.experts.")
            experts = self.get_submodule(f"{module_name}.mlp.experts")
            return f"{module_name}.mlp.experts.{experts.load(param_name, tensor)}"
        if name.endswith(".self_attn.sinks"):  # this rank's heads
            state = get_parallel_state()
            tensor = tensor.float().chunk(state.tp_size)[state.tp_rank]
            name = name.replace(".self_attn.sinks", ".self_attn.attn.sinks")
        return super().load_tensor(name, tensor, params)
