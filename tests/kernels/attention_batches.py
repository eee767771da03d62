"""Ragged batches over a paged KV cache, built the way the engine lays them out, for attention tests."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvforge.kernels.kv_quant import dequantize_kv, quantize_kv
from kvforge.kernels.paged_attention import paged_attention_ref, paged_attention_triton

# Measured max |out - ref| on unit-normal inputs (|out| < 2): fp32 2e-6, fp16 1e-3, bf16 1.6e-2 (the
# interpreter truncates fp32 -> bf16 where a GPU rounds to nearest).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2.4e-2}


@dataclass(slots=True)
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with the null block 0
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32

    def args(self) -> tuple[torch.Tensor, ...]:
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_tables,
            self.query_start_loc,
            self.seq_lens,
        )

    def contiguous_kv(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one sequence, read out of the pages by hand: [seq_len, num_kv_heads, dim]."""
        block_size = self.key_cache.shape[1]
        positions = torch.arange(int(self.seq_lens[seq]), device=self.key_cache.device)
        blocks = self.block_tables[seq].long()[positions // block_size]
        return self.key_cache[blocks, positions % block_size], self.value_cache[
            blocks, positions % block_size
        ]

    def used_slots(self) -> torch.Tensor:
        """[num_blocks, block_size] bool: the cache slots inside some sequence's context."""
        used = torch.zeros(self.key_cache.shape[:2], dtype=torch.bool, device=self.key_cache.device)
        block_size = self.key_cache.shape[1]
        for seq in range(self.seq_lens.shape[0]):
            positions = torch.arange(int(self.seq_lens[seq]), device=used.device)
            used[self.block_tables[seq].long()[positions // block_size], positions % block_size] = True
        return used

    def poison_unused_slots(self) -> None:
        """NaN in every cache slot outside the sequences' contexts (the null block included), so a
        kernel that reads past a context or through a padded block-table entry produces NaN."""
        used = self.used_slots()
        self.key_cache[~used] = float("nan")
        self.value_cache[~used] = float("nan")


def make_paged_batch(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    spare_blocks: int = 3,
) -> PagedBatch:
    """Sequence s has seq_lens[s] tokens in context, the last q_lens[s] of them queried this step.

    Blocks are drawn in random order from 1 .. num_blocks - 1 (block 0 is the null block that pads
    the block tables), with spare_blocks never used."""
    if len(q_lens) != len(seq_lens) or any(q > s for q, s in zip(q_lens, seq_lens, strict=True)):
        raise ValueError(f"need q_len <= seq_len per sequence, got {q_lens} and {seq_lens}")
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + spare_blocks
    order = (torch.randperm(num_blocks - 1) + 1).tolist()
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    for seq, count in enumerate(blocks_per_seq):
        block_tables[seq, :count] = torch.tensor(order[:count], dtype=torch.int32)
        order = order[count:]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return PagedBatch(
        query=torch.randn(sum(q_lens), num_heads, head_dim).to(device, dtype),
        key_cache=torch.randn(cache_shape).to(device, dtype),
        value_cache=torch.randn(cache_shape).to(device, dtype),
        block_tables=block_tables.to(device),
        query_start_loc=starts.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )


def run_and_compare(batch: PagedBatch, num_splits: int | None = None) -> None:
    """Reference on the clean cache; kernel on a cache whose unused slots are NaN, into a NaN output."""
    scale = batch.query.shape[-1] ** -0.5
    expected = paged_attention_ref(*batch.args(), scale)
    batch.poison_unused_slots()
    out = torch.full_like(batch.query, float("nan"))
    paged_attention_triton(*batch.args(), scale, out=out, num_splits=num_splits)
    tol = TOLERANCE[batch.query.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


def quantize_batch_cache(batch: PagedBatch, code_dtype: torch.dtype) -> tuple[PagedBatch, torch.Tensor, torch.Tensor]:
    """The batch with its caches replaced by codes; NaN scales in every slot outside the contexts."""
    key_codes, key_scale = quantize_kv(batch.key_cache, code_dtype)
    value_codes, value_scale = quantize_kv(batch.value_cache, code_dtype)
    used = batch.used_slots()
    key_scale[~used] = float("nan")
    value_scale[~used] = float("nan")
    return dataclasses.replace(batch, key_cache=key_codes, value_cache=value_codes), key_scale, value_scale


def dequantized_reference(
    batch: PagedBatch, key_scale: torch.Tensor, value_scale: torch.Tensor, scale: float
) -> torch.Tensor:
    """paged_attention_ref over float caches holding the dequantized values (unused slots 0)."""
    key_cache = dequantize_kv(batch.key_cache, key_scale.nan_to_num(), torch.float32)
    value_cache = dequantize_kv(batch.value_cache, value_scale.nan_to_num(), torch.float32)
    float_batch = dataclasses.replace(batch, query=batch.query.float(), key_cache=key_cache, value_cache=value_cache)
    return paged_attention_ref(*float_batch.args(), scale)
