"""Multi-head latent attention (DeepSeek-V2/V3) over the paged latent cache.

Keys and values are compressed to one latent per token: c = norm(x W_DKV) (kv_lora_rank), plus one roped
key k_r (qk_rope_head_dim) shared by all heads. Only [c | k_r] is cached. Per head h, the key is
[c W_UK[h] | k_r] and the value c W_UV[h], where kv_b_proj holds [W_UK[h]; W_UV[h]] for every head.

    prefill chunk  expanded form: the context's latents are up-projected to per-head keys and values,
                   then causal attention (torch SDPA), as cheap as multi-head attention in FLOPs
    decode         absorbed form: q_nope W_UK[h] turns the query into latent space, attention runs over
                   the cached rows directly (ops.mla_decode), and W_UV[h] maps the latent output back
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.distributed.parallel_state import get_parallel_state
from kvforge.kernels.ops import current_ops
from kvforge.kernels.paged_attention import gather_kv
from kvforge.layers.attention import AttentionMetadata
from kvforge.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from kvforge.layers.norm import RMSNorm
from kvforge.layers.rotary import RotaryEmbedding

# NOTE: the checkpoints' q_a_layernorm and kv_a_layernorm use this eps, not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class MLADims:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None  # None: one full query projection (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float
    attention_bias: bool = False

    def __post_init__(self) -> None:
        sizes = (self.hidden_size, self.num_heads, self.kv_lora_rank, self.qk_nope_head_dim,
                 self.qk_rope_head_dim, self.v_head_dim, self.q_lora_rank or 1)  # fmt: skip
        if min(sizes) < 1:
            raise ValueError(f"MLA sizes must be >= 1, got {self}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Cached values per token and layer: the latent and the shared roped key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


class MultiHeadLatentAttention(nn.Module):
    """Parameter names follow the checkpoints (q_a_proj, kv_a_proj_with_mqa, kv_b_proj, ...).

    Under tensor parallelism each rank holds num_heads / tp heads: the up-projections (q_b_proj or q_proj,
    kv_b_proj) are split by head and o_proj by its input; the down-projections to the latent spaces and
    the latent cache are whole on every rank (every head reads the same latent)."""

    def __init__(self, dims: MLADims, rotary: RotaryEmbedding, dtype: torch.dtype = torch.float32) -> None:
        """dtype: of the parameters (the run dtype)."""
        super().__init__()
        self.dims = dims
        self.ops = current_ops()
        heads, bias = dims.num_heads, dims.attention_bias
        tp_size = get_parallel_state().tp_size
        if heads % tp_size:
            raise ValueError(f"{heads} latent-attention heads cannot be split over {tp_size} tensor-parallel ranks")
        self.num_heads = heads // tp_size  # this rank's
        if dims.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(dims.hidden_size, [heads * dims.qk_head_dim], dtype=dtype)
        else:
            self.q_a_proj = Linear(dims.hidden_size, [dims.q_lora_rank], bias=bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(dims.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = ColumnParallelLinear(dims.q_lora_rank, [heads * dims.qk_head_dim], dtype=dtype)
        self.kv_a_proj_with_mqa = Linear(dims.hidden_size, [dims.cache_dim], bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = ColumnParallelLinear(dims.kv_lora_rank, [heads * (dims.qk_nope_head_dim + dims.v_head_dim)],
                                              dtype=dtype)
        self.o_proj = RowParallelLinear(heads * dims.v_head_dim, [dims.hidden_size], bias=bias, dtype=dtype)
        self.rotary = rotary  # NOTE: one module shared by all layers: one cos/sin table

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: tuple[torch.Tensor, ...],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # fmt: skip
        """x: [num_tokens, hidden]; kv_cache: (latent cache [num_blocks, block_size, cache_dim],)."""
        d = self.dims
        num_tokens = x.shape[0]
        if d.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(num_tokens, self.num_heads, d.qk_head_dim).split(
            [d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)  # fmt: skip
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([d.kv_lora_rank, d.qk_rope_head_dim], dim=-1)
        q_rope, k_rope = self.rotary(positions, q_rope, k_rope.unsqueeze(1))
        (latent_cache,) = kv_cache
        rows = torch.cat((self.kv_a_layernorm(latent), k_rope.squeeze(1)), dim=-1)  # [num_tokens, cache_dim]
        latent_cache.view(-1, d.cache_dim).index_copy_(0, metadata.slot_mapping, rows.to(latent_cache.dtype))
        out = self._attend(q_nope, q_rope, latent_cache, metadata)  # [num_tokens, heads, v_head_dim]
        return self.o_proj(out.reshape(num_tokens, -1))

    def _attend(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # fmt: skip
        """Decodes (one query) in the absorbed form, together; prefill chunks expanded, one at a time."""
        # NOTE: a host sync per layer to split decodes from prefill chunks.
        starts = metadata.query_start_loc.tolist()
        q_lens = [end - start for start, end in zip(starts[:-1], starts[1:], strict=True)]
        decodes = [s for s, q_len in enumerate(q_lens) if q_len == 1]
        if len(decodes) == len(q_lens):
            return self._decode(q_nope, q_rope, latent_cache, metadata.block_tables, metadata.seq_lens)
        out = q_nope.new_empty((q_nope.shape[0], self.num_heads, self.dims.v_head_dim))
        if decodes:
            seqs = torch.tensor(decodes, device=q_nope.device)
            rows = metadata.query_start_loc[seqs]
            out[rows] = self._decode(q_nope[rows], q_rope[rows], latent_cache, metadata.block_tables[seqs],
                                     metadata.seq_lens[seqs])  # fmt: skip
        seq_lens = metadata.seq_lens.tolist()
        for s, q_len in enumerate(q_lens):
            if q_len > 1:
                rows = slice(starts[s], starts[s + 1])
                out[rows] = self._prefill(q_nope[rows], q_rope[rows], latent_cache,
                                          metadata.block_tables[s : s + 1], seq_lens[s])  # fmt: skip
        return out

    def _up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [heads, nope, kv_lora_rank] and W_UV [heads, v, kv_lora_rank]: views of kv_b_proj."""
        d = self.dims
        weight = self.kv_b_proj.weight.view(self.num_heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)
        return weight[:, : d.qk_nope_head_dim], weight[:, d.qk_nope_head_dim :]

    def _decode(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor,
        block_tables: torch.Tensor, seq_lens: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """Absorbed form. q_nope: [num_seqs, heads, nope]; q_rope: [num_seqs, heads, rope] (one token
        each). Returns [num_seqs, heads, v_head_dim]."""
        w_uk, w_uv = self._up_projections()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [num_seqs, heads, kv_lora_rank]
        query = torch.cat((q_latent, q_rope), dim=-1)
        latent_out = self.ops.mla_decode(query, latent_cache, block_tables, seq_lens, self.dims.softmax_scale,
                                    self.dims.kv_lora_rank)  # fmt: skip
        return torch.bmm(latent_out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _prefill(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor,
        block_table: torch.Tensor, seq_len: int,
    ) -> torch.Tensor:  # fmt: skip
        """Expanded form, one sequence whose last q_len of seq_len tokens are the queries.
        Returns [q_len, heads, v_head_dim]."""
        d = self.dims
        rows = gather_kv(latent_cache, block_table, seq_len)[0]  # [seq_len, cache_dim]
        kv = self.kv_b_proj(rows[:, : d.kv_lora_rank]).view(seq_len, self.num_heads, -1)
        k_nope, value = kv.split([d.qk_nope_head_dim, d.v_head_dim], dim=-1)
        k_rope = rows[:, None, d.kv_lora_rank :].expand(seq_len, self.num_heads, d.qk_rope_head_dim)
        key = torch.cat((k_nope, k_rope), dim=-1)
        query = torch.cat((q_nope, q_rope), dim=-1)
        q_len = query.shape[0]
        mask = None
        if q_len < seq_len:  # queries follow earlier chunks or cached blocks: causal from an offset
            positions = torch.arange(seq_len, device=query.device)
            mask = positions[None, :] <= positions[seq_len - q_len :, None]  # [q_len, seq_len]
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
            attn_mask=mask, is_causal=mask is None, scale=d.softmax_scale,
        )  # fmt: skip
        return out.transpose(0, 1)
