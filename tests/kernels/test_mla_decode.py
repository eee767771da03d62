"""MLA decode over the paged latent cache: the Triton kernel against the torch reference, and the absorbed
form against plain multi-head attention over the expanded keys and values."""

from __future__ import annotations

import pytest
import torch

from kvforge.kernels.mla_decode import mla_decode_ref, mla_decode_triton

# Measured (|out| < 1.7): fp32 <= 5e-7; fp16 <= 1e-3 and bf16 <= 1.6e-2, one ulp of the rounded output.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _batch(seq_lens: list[int], num_heads: int, latent_dim: int, rope_dim: int, block_size: int,
           dtype: torch.dtype, device: torch.device):  # fmt: skip
    """A latent cache with each sequence's blocks scattered over it (block 0 unused) and one query each."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq)
    cache = torch.randn(num_blocks, block_size, latent_dim + rope_dim).to(device, dtype)
    block_ids = (torch.randperm(num_blocks - 1) + 1).tolist()
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = torch.tensor(block_ids[:n])
        block_ids = block_ids[n:]
    query = torch.randn(len(seq_lens), num_heads, latent_dim + rope_dim).to(device, dtype)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return query, cache, block_tables.to(device), seq_lens_t


@pytest.mark.parametrize(
    "seq_lens, num_heads, latent_dim, rope_dim, block_size, num_splits",
    [
        ([1, 37, 70], 20, 24, 8, 16, None),  # heads not a multiple of 16, default splits
        ([5, 300], 16, 64, 16, 32, 3),  # splits that do not divide the context
        ([17], 4, 16, 8, 1, 1),  # one-token pages
        ([600, 2], 128, 32, 16, 16, 4),  # DeepSeek's 128 heads, a long context beside a short one
    ],
)
def test_triton_matches_reference(device, seq_lens, num_heads, latent_dim, rope_dim, block_size, num_splits):
    args = _batch(seq_lens, num_heads, latent_dim, rope_dim, block_size, torch.float32, device)
    out = mla_decode_triton(*args, 0.1, latent_dim, num_splits=num_splits)
    torch.testing.assert_close(out, mla_decode_ref(*args, 0.1, latent_dim), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_triton_half_precision(device, dtype, num_splits):
    args = _batch([9, 50], 16, 32, 16, 16, dtype, device)
    out = mla_decode_triton(*args, 0.15, 32, num_splits=num_splits)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), mla_decode_ref(*args, 0.15, 32).float(), atol=tol, rtol=tol)


def test_absorbed_form_equals_expanded_attention():
    """softmax(q_nope W_UK[h] . c + q_r . k_r) @ c, then W_UV[h]: the same as per-head attention with keys
    [W_UK[h] c | k_r] and values W_UV[h] c."""
    num_heads, latent_dim, rope_dim, nope, v_dim, seq_len = 3, 16, 8, 12, 10, 21
    torch.manual_seed(1)
    latent = torch.randn(seq_len, latent_dim, dtype=torch.float64)
    k_rope = torch.randn(seq_len, rope_dim, dtype=torch.float64)
    w_uk = torch.randn(num_heads, nope, latent_dim, dtype=torch.float64)
    w_uv = torch.randn(num_heads, v_dim, latent_dim, dtype=torch.float64)
    q_nope = torch.randn(num_heads, nope, dtype=torch.float64)
    q_rope = torch.randn(num_heads, rope_dim, dtype=torch.float64)
    scale = 0.2
    keys = torch.cat((torch.einsum("hnr,tr->htn", w_uk, latent), k_rope.expand(num_heads, -1, -1)), dim=-1)
    values = torch.einsum("hvr,tr->htv", w_uv, latent)
    probs = torch.softmax(torch.einsum("hd,htd->ht", torch.cat((q_nope, q_rope), -1), keys) * scale, -1)
    expected = torch.einsum("ht,htv->hv", probs, values)

    cache = torch.cat((latent, k_rope), dim=-1).view(1, seq_len, -1).float()  # one block of seq_len slots
    query = torch.cat((torch.einsum("hn,hnr->hr", q_nope, w_uk), q_rope), dim=-1)[None].float()
    latent_out = mla_decode_ref(query, cache, torch.zeros(1, 1, dtype=torch.int32),
                                torch.tensor([seq_len], dtype=torch.int32), scale, latent_dim)[0]  # fmt: skip
    ours = torch.einsum("hr,hvr->hv", latent_out.double(), w_uv)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_block_ids_past_int32_offsets(device):
    """Block ids whose element offset, block * stride, is past 2**31."""
    block_size, row_dim, num_blocks = 16, 32, 4_300_000
    try:  # uninitialised: on the CPU only the pages the test touches are backed by memory
        cache = torch.empty(num_blocks, block_size, row_dim, dtype=torch.float16, device=device)
    except (RuntimeError, MemoryError) as error:
        pytest.skip(f"cannot reserve a {num_blocks}-block cache: {error}")
    assert (num_blocks - 1) * cache.stride(0) > 2**31
    high_blocks = [[4_299_999, 7, 4_200_000], [4_194_305, 0, 0]]
    block_tables = torch.tensor(high_blocks, dtype=torch.int32, device=device)
    for block in block_tables.flatten().tolist():
        cache[block] = torch.randn(block_size, row_dim, dtype=torch.float16, device=device)
    query = torch.randn(2, 16, row_dim, dtype=torch.float16, device=device)
    seq_lens = torch.tensor([40, 3], dtype=torch.int32, device=device)
    out = mla_decode_triton(query, cache, block_tables, seq_lens, 0.2, 24, num_splits=2)
    expected = mla_decode_ref(query, cache, block_tables, seq_lens, 0.2, 24)
    torch.testing.assert_close(out.float(), expected.float(), atol=4e-3, rtol=4e-3)


def test_launcher_rejects_bad_inputs(device):
    query, cache, block_tables, seq_lens = _batch([3], 4, 16, 8, 16, torch.float32, device)
    with pytest.raises(ValueError, match="latent_dim"):
        mla_decode_triton(query, cache, block_tables, seq_lens, 0.1, 24)
    with pytest.raises(ValueError, match="latent_cache"):
        mla_decode_triton(query, cache[..., :20], block_tables, seq_lens, 0.1, 16)


def test_custom_op_passes_opcheck(device):
    args = _batch([3, 20], 16, 16, 16, 16, torch.float32, device)
    torch.library.opcheck(torch.ops.kvforge.mla_decode, (*args, 0.1, 16),
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip
