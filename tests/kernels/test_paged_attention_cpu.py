"""The CPU attention path (SDPA over gathered blocks) against the readable reference."""

from __future__ import annotations

import random

import pytest
import torch

from kvforge.kernels.paged_attention import paged_attention_ref
from kvforge.kernels.paged_attention_cpu import DECODE_GROUP, paged_attention_cpu
from tests.kernels.attention_batches import TOLERANCE, make_paged_batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch_matches_reference(dtype: torch.dtype, group: int, block_size: int) -> None:
    rng = random.Random(group * block_size)
    num_decodes = 2 * DECODE_GROUP + 3  # several length groups, the last one short
    decode_lens = [rng.randint(1, 200) for _ in range(num_decodes)]
    # prefills: fresh (q_len == seq_len), after a prefix ending mid-block, and a single long chunk
    q_lens = [1] * num_decodes + [37, 20, 5]
    seq_lens = decode_lens + [37, 20 + 45, 5 + 2 * block_size]
    batch = make_paged_batch(q_lens, seq_lens, num_heads=2 * group, num_kv_heads=2, head_dim=64,
                             block_size=block_size, dtype=dtype)
    # The torch paths read padded slots before masking them, so the (engine-like) cache stays finite.
    scale = 64**-0.5
    expected = paged_attention_ref(*batch.args(), scale)
    got = paged_attention_cpu(*batch.args(), scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
