"""The torch reference paged_attention_ref against an independent oracle: per-sequence
torch.nn.functional.scaled_dot_product_attention on keys and values read out of the pages by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvforge.kernels.paged_attention import paged_attention_ref
from tests.kernels.attention_batches import PagedBatch, make_paged_batch


def sdpa_oracle(batch: PagedBatch, scale: float) -> torch.Tensor:
    """fp32 attention of each sequence's queries over its contiguous context, causal from its offset."""
    starts = batch.query_start_loc.tolist()
    group = batch.query.shape[1] // batch.key_cache.shape[2]
    outs = []
    for seq in range(batch.seq_lens.shape[0]):
        q = batch.query[starts[seq] : starts[seq + 1]].float().transpose(0, 1)  # [H, Q, D]
        k, v = (t.float().transpose(0, 1).repeat_interleave(group, dim=0) for t in batch.contiguous_kv(seq))
        q_len, seq_len = q.shape[1], k.shape[1]
        visible = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (80, 32)])
def test_ref_matches_sdpa_on_mixed_batch(
    dtype: torch.dtype, group: int, head_dim: int, block_size: int
) -> None:
    # decodes, a fresh prefill, a chunk after a prefix-cache hit; contexts end mid-block
    q_lens, seq_lens = [1, 7, 1, 33, 1], [9, 7, 40, 50, 1]
    batch = make_paged_batch(
        q_lens,
        seq_lens,
        num_heads=2 * group,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    scale = head_dim**-0.5
    out = paged_attention_ref(*batch.args(), scale)
    expected = sdpa_oracle(batch, scale)
    # fp32: summation order only; fp16/bf16: the output's rounding, measured <= 1 ulp
    tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_ref_single_key_returns_its_value() -> None:
    """A one-token sequence attends to itself only: the output is its value, whatever the query."""
    batch = make_paged_batch(
        [1], [1], num_heads=4, num_kv_heads=1, head_dim=8, block_size=16, dtype=torch.float32
    )
    out = paged_attention_ref(*batch.args(), 0.3)
    value = batch.contiguous_kv(0)[1]  # [1, 1, 8]
    torch.testing.assert_close(out, value.expand(1, 4, 8))
