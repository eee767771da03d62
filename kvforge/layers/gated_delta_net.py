"""The Gated DeltaNet token mixer of Qwen3-Next and Qwen3.5: linear attention with a fixed-size state per request.

    x ─► in-projections ─► q k v (concatenated) ─► causal conv1d + SiLU (conv state) ─► q k v per head
                       ├─► z (output gate), b (beta = sigmoid(b)), a (g = -exp(A_log) softplus(a + dt_bias))
    q k v g beta ─► gated delta rule (delta state; chunked over a prompt, one step per decode) ─► o
    o ─► RMSNorm(o) * weight * silu(z) per value head ─► out_proj

Value heads may outnumber key heads (Qwen3-Next: 32 to 16): each key head serves value_heads / key_heads consecutive
value heads. The conv and delta states live in the request's slot of the layer's state tensors (metadata.state_slot_ids;
a request's first step starts from zeros, metadata.has_initial_state).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.distributed.parallel_state import get_parallel_state
from kvforge.kernels.ops import current_ops
from kvforge.layers.attention import AttentionMetadata
from kvforge.layers.linear import ColumnParallelLinear, RowParallelLinear
from kvforge.layers.norm import RMSNorm


@dataclass(frozen=True, slots=True)
class GatedDeltaNetConfig:
    hidden_size: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_width: int
    rms_norm_eps: float

    @classmethod
    def from_hf(cls, hf: dict) -> GatedDeltaNetConfig:
        return cls(hidden_size=hf["hidden_size"], num_key_heads=hf["linear_num_key_heads"],
                   num_value_heads=hf["linear_num_value_heads"], key_head_dim=hf["linear_key_head_dim"],
                   value_head_dim=hf["linear_value_head_dim"], conv_width=hf.get("linear_conv_kernel_dim", 4),
                   rms_norm_eps=hf.get("rms_norm_eps", 1e-6))

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """The conv's channels: q, k and v of every head, in that order."""
        return 2 * self.key_dim + self.value_dim


class GatedDeltaNet(nn.Module):
    """One linear-attention layer. Checkpoint layouts of its in-projections:

        grouped (Qwen3-Next)   in_proj_qkvz: per key head [q, k, v of its value heads, z of them]; in_proj_ba: per key
                               head [b of its value heads, a of them]
        separate (Qwen3.5)     in_proj_qkv: [q of all heads, k, v]; in_proj_z; in_proj_b; in_proj_a
    """

    def __init__(self, cfg: GatedDeltaNetConfig, grouped: bool, dtype: torch.dtype = torch.float32) -> None:
        """dtype: of the parameters (the run dtype)."""
        super().__init__()
        state = get_parallel_state()
        self.tp_size, self.tp_rank = state.tp_size, state.tp_rank
        if cfg.num_key_heads % self.tp_size:
            raise ValueError(f"{cfg.num_key_heads} linear-attention key heads cannot be split over "
                             f"tensor_parallel_size={self.tp_size}")
        full = cfg
        # NOTE: tensor parallelism splits the key heads, each with the value heads it serves: cfg is this rank's part
        self.cfg = cfg = replace(cfg, num_key_heads=cfg.num_key_heads // self.tp_size,
                                 num_value_heads=cfg.num_value_heads // self.tp_size)
        self.grouped = grouped
        if grouped:  # whole key-head groups per rank: the rows split evenly
            self.in_proj_qkvz = ColumnParallelLinear(full.hidden_size, [full.conv_dim + full.value_dim], dtype=dtype)
            self.in_proj_ba = ColumnParallelLinear(full.hidden_size, [2 * full.num_value_heads], dtype=dtype)
        else:  # q, k and v each split (one checkpoint tensor: load_param cuts it into the three)
            self.in_proj_qkv = ColumnParallelLinear(full.hidden_size, [full.key_dim, full.key_dim, full.value_dim],
                                                    dtype=dtype)
            self.in_proj_z = ColumnParallelLinear(full.hidden_size, [full.value_dim], dtype=dtype)
            self.in_proj_b = ColumnParallelLinear(full.hidden_size, [full.num_value_heads], dtype=dtype)
            self.in_proj_a = ColumnParallelLinear(full.hidden_size, [full.num_value_heads], dtype=dtype)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.conv_width, groups=cfg.conv_dim, bias=False,
                                dtype=dtype)
        self.conv1d.requires_grad_(False)
        self.A_log = nn.Parameter(torch.zeros(cfg.num_value_heads, dtype=dtype), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.ones(cfg.num_value_heads, dtype=dtype), requires_grad=False)
        # its weight multiplies, unlike the stack's (1 + w)
        self.norm = RMSNorm(cfg.value_head_dim, cfg.rms_norm_eps, dtype)
        self.out_proj = RowParallelLinear(full.value_dim, [cfg.hidden_size], dtype=dtype)
        self.ops = current_ops()

    def _rank_part(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.chunk(self.tp_size)[self.tp_rank]

    def load_param(self, name: str, tensor: torch.Tensor) -> str:
        """Load a checkpoint tensor that is not a whole linear layer's own: in_proj_qkv (three shards in one tensor),
        and this rank's part of the conv's channels ([q | k | v], each split) and of A_log and dt_bias (per value
        head). Returns the parameter filled (relative to this layer)."""
        if name == "in_proj_qkv.weight":
            full = [self.tp_size * size for size in (self.cfg.key_dim, self.cfg.key_dim, self.cfg.value_dim)]
            for shard, part in enumerate(tensor.split(full)):
                self.in_proj_qkv.load_shard("weight", shard, part)
            return name
        if name == "conv1d.weight":
            tensor = tensor.view(-1, 1, self.cfg.conv_width)
            full = [self.tp_size * size for size in (self.cfg.key_dim, self.cfg.key_dim, self.cfg.value_dim)]
            tensor = torch.cat([self._rank_part(part) for part in tensor.split(full)])
        else:
            assert name in ("A_log", "dt_bias"), name
            tensor = self._rank_part(tensor)
        param = self.get_parameter(name)
        if param.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(param.shape)}")
        param.data.copy_(tensor)
        return name

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mixed q k v [T, conv_dim], z [T, value_heads, value_head_dim], b, a [T, value_heads])."""
        cfg, num_tokens = self.cfg, x.shape[0]
        if not self.grouped:
            z = self.in_proj_z(x).view(num_tokens, cfg.num_value_heads, cfg.value_head_dim)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        ratio = cfg.num_value_heads // cfg.num_key_heads
        per_key_head = [cfg.key_head_dim, cfg.key_head_dim, ratio * cfg.value_head_dim, ratio * cfg.value_head_dim]
        q, k, v, z = self.in_proj_qkvz(x).view(num_tokens, cfg.num_key_heads, -1).split(per_key_head, dim=-1)
        b, a = self.in_proj_ba(x).view(num_tokens, cfg.num_key_heads, 2 * ratio).split([ratio, ratio], dim=-1)
        mixed = torch.cat([q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v.reshape(num_tokens, -1)], dim=-1)
        z = z.reshape(num_tokens, cfg.num_value_heads, cfg.value_head_dim)
        return mixed, z, b.reshape(num_tokens, -1), a.reshape(num_tokens, -1)

    def _conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight.view(self.cfg.conv_dim, self.cfg.conv_width)

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output [T, conv_dim] -> q, k [T, value_heads, key_head_dim] (a key head repeated for each of
        its value heads), v [T, value_heads, value_head_dim]."""
        cfg, num_tokens = self.cfg, mixed.shape[0]
        q, k, v = mixed.split([cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        q = q.reshape(num_tokens, cfg.num_key_heads, cfg.key_head_dim)
        k = k.reshape(num_tokens, cfg.num_key_heads, cfg.key_head_dim)
        v = v.reshape(num_tokens, cfg.num_value_heads, cfg.value_head_dim)
        if cfg.num_value_heads != cfg.num_key_heads:
            ratio = cfg.num_value_heads // cfg.num_key_heads
            q, k = q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)
        return q, k, v

    def _verify(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: tuple[torch.Tensor, ...],
                metadata: AttentionMetadata) -> torch.Tensor:
        """A step with drafts: one position of every sequence at a time (one-token conv and delta steps), the
        states after position j kept in scratch[j] (executor/recurrent_states.py commits the accepted one).

        NOTE: a prefill chunk in the same step runs a position at a time too: past its first token it continues its
        own state, and past the scratch (the drafting sequences' last position) its states are not kept."""
        conv_state, delta_state, conv_scratch, delta_scratch = state
        cfg = self.cfg
        out = mixed.new_empty((mixed.shape[0], cfg.num_value_heads, cfg.value_head_dim))
        for position, (rows, seqs) in enumerate(metadata.verification_rows):
            slots, initial = metadata.state_slot_ids[seqs], metadata.has_initial_state[seqs]
            if position > 0:
                initial = torch.ones_like(initial)
            one_each = torch.arange(rows.shape[0] + 1, device=rows.device, dtype=torch.int32)
            conv = self.ops.causal_conv1d(mixed[rows], self._conv_weight(), None, conv_state, one_each, slots, initial,
                                          True)
            q, k, v = self._heads(conv)
            out[rows] = self.ops.gated_delta_decode(q, k, v, g[rows], beta[rows], delta_state, slots, initial)
            if position < conv_scratch.shape[0]:
                conv_scratch[position, slots.long()] = conv_state[slots.long()]
                delta_scratch[position, slots.long()] = delta_state[slots.long()]
        return out

    def forward(self, positions: torch.Tensor, x: torch.Tensor, state: tuple[torch.Tensor, ...],
                metadata: AttentionMetadata) -> torch.Tensor:
        """x: [num_tokens, hidden]; state: this layer's (conv_state, delta_state) of every slot, updated in place (then
        their scratch under speculative decoding). positions: unused (the conv and the recurrence are the position)."""
        cfg, num_tokens = self.cfg, x.shape[0]
        mixed, z, b, a = self._project(x)
        beta = b.float().sigmoid()  # [num_tokens, value_heads]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        if metadata.verification_rows is not None:
            out = self._verify(mixed, g, beta, state, metadata)
        else:
            slots, initial = metadata.state_slot_ids, metadata.has_initial_state
            mixed = self.ops.causal_conv1d(mixed, self._conv_weight(), None, state[0], metadata.query_start_loc, slots,
                                           initial, True)
            q, k, v = self._heads(mixed)
            if metadata.decode_only:
                out = self.ops.gated_delta_decode(q, k, v, g, beta, state[1], slots, initial)
            else:
                out = self.ops.gated_delta_prefill(q, k, v, g, beta, state[1], metadata.query_start_loc, slots,
                                                   initial)
        # [num_tokens, value_heads, value_head_dim]: RMSNorm per head, then the SiLU gate of z (in fp32)
        normed = self.norm(out.reshape(-1, cfg.value_head_dim))
        gated = (normed.float() * F.silu(z.reshape(-1, cfg.value_head_dim).float())).to(x.dtype)
        return self.out_proj(gated.view(num_tokens, cfg.value_dim))
