"""The Triton paged attention (prefill + flash-decoding kernels) against paged_attention_ref."""

from __future__ import annotations

import pytest
import torch

from kvforge.kernels.cache_write import reshape_and_cache_triton
from kvforge.kernels.paged_attention import paged_attention_ref, paged_attention_triton
from tests.kernels.attention_batches import TOLERANCE, PagedBatch, make_paged_batch, run_and_compare


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_mixed_ragged_batch(device: torch.device, dtype: torch.dtype, group: int) -> None:
    # decode, chunk after 23 cached tokens, decode, fresh prefill, decode; contexts end mid-block
    batch = make_paged_batch(
        [1, 37, 1, 20, 1],
        [50, 60, 17, 20, 33],
        num_heads=2 * group,
        num_kv_heads=2,
        head_dim=128,
        block_size=16,
        dtype=dtype,
        device=device,
    )
    run_and_compare(batch, num_splits=2)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_head_sizes(device: torch.device, head_dim: int) -> None:
    batch = make_paged_batch(
        [19, 1, 1],
        [19, 45, 64],
        num_heads=4,
        num_kv_heads=1,
        head_dim=head_dim,
        block_size=32,
        dtype=torch.float16,
        device=device,
    )
    run_and_compare(batch)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_only_batch_splits(device: torch.device, block_size: int, num_splits: int) -> None:
    """Only decodes (no prefill launch); more splits than some contexts have key tiles."""
    seq_lens = [1, 15, 16, 17, block_size + 1, 100]
    batch = make_paged_batch(
        [1] * len(seq_lens),
        seq_lens,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=block_size,
        dtype=torch.float16,
        device=device,
    )
    run_and_compare(batch, num_splits=num_splits)


def test_prefill_only_batch(device: torch.device) -> None:
    """Chunks of two and three queries, the smallest the prefill kernel takes, after cached context."""
    batch = make_paged_batch(
        [2, 3, 70],
        [2, 40, 90],
        num_heads=8,
        num_kv_heads=8,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        device=device,
    )
    run_and_compare(batch)


def test_long_context(device: torch.device) -> None:
    """A 96-token chunk after 3000 cached tokens beside a decode over 4000, one KV head."""
    batch = make_paged_batch(
        [96, 1],
        [3096, 4000],
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
        block_size=32,
        dtype=torch.float16,
        device=device,
    )
    run_and_compare(batch, num_splits=4)


def _huge_paged_cache(num_blocks: int, block_size: int, device: torch.device) -> torch.Tensor:
    """K and V halves of one [num_blocks, 2, block_size, 1, 64] fp16 tensor; left uninitialised, so on
    the CPU only the pages the test touches are ever backed by memory."""
    try:
        return torch.empty(num_blocks, 2, block_size, 1, 64, dtype=torch.float16, device=device)
    except (RuntimeError, MemoryError) as error:  # no overcommit, or a small GPU
        pytest.skip(f"cannot reserve a {num_blocks}-block cache: {error}")


def test_block_ids_past_int32_offsets(device: torch.device) -> None:
    """Block ids whose element offset, block * stride, is past 2**31: naive int32 math wraps around."""
    block_size, num_blocks = 16, 1_100_000
    kv = _huge_paged_cache(num_blocks, block_size, device)
    key_cache, value_cache = kv[:, 0], kv[:, 1]  # stride(0) = 2048 elements: block 1_048_576 hits 2**31
    assert (num_blocks - 1) * key_cache.stride(0) > 2**31
    seq_lens = [40, 1, 20]
    q_lens = [1, 1, 20]
    high_blocks = [[1_099_999, 7, 1_050_000], [1_048_577, 0, 0], [1_060_001, 1_099_998, 0]]
    block_tables = torch.tensor(high_blocks, dtype=torch.int32, device=device)
    # write each context through the cache-write kernel at its (huge) slots, then attend over it
    positions = [torch.arange(n) for n in seq_lens]
    slots = torch.cat(
        [
            block_tables[s].cpu().long()[p // block_size] * block_size + p % block_size
            for s, p in enumerate(positions)
        ]
    ).to(device)
    keys = torch.randn(slots.shape[0], 1, 64).to(device, torch.float16)
    values = torch.randn_like(keys)
    reshape_and_cache_triton(keys, values, key_cache, value_cache, slots)
    batch = PagedBatch(
        query=torch.randn(sum(q_lens), 4, 64).to(device, torch.float16),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        query_start_loc=torch.tensor([0, 1, 2, 22], dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )
    torch.testing.assert_close(batch.contiguous_kv(0)[0], keys[:40])  # the write landed where it should
    out = torch.full_like(batch.query, float("nan"))
    paged_attention_triton(*batch.args(), 0.125, out=out, num_splits=2)
    expected = paged_attention_ref(*batch.args(), 0.125)
    torch.testing.assert_close(out, expected, atol=TOLERANCE[torch.float16], rtol=TOLERANCE[torch.float16])


def test_rejects_bad_inputs(device: torch.device) -> None:
    batch = make_paged_batch(
        [1, 3],
        [5, 3],
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float16,
        device=device,
    )
    args = batch.args()
    with pytest.raises(ValueError, match="dtype"):
        paged_attention_triton(args[0].float(), *args[1:], 0.1)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention_triton(args[0][:, :3], *args[1:], 0.1)
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention_triton(*args[:3], args[3].float(), *args[4:], 0.1)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention_triton(*args[:4], args[4][:2], args[5], 0.1)
    with pytest.raises(ValueError, match="out"):
        paged_attention_triton(*args, 0.1, out=torch.empty_like(args[0])[:2])
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention_triton(*args, 0.1, num_splits=0)
    with pytest.raises(ValueError, match="scale"):
        paged_attention_triton(*args, float("nan"))
