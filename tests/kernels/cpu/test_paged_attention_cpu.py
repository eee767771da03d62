"""The CPU attention path (SDPA over gathered blocks) against the readable reference."""

from __future__ import annotations

import random

import pytest
import torch

import kvforge.kernels.cpu.paged_attention as paged_attention_cpu_module
from kvforge.kernels.cpu.extension import cpu_kernels
from kvforge.kernels.cpu.paged_attention import DECODE_GROUP, paged_attention_cpu
from kvforge.kernels.paged_attention import paged_attention_ref
from tests.kernels.attention_batches import TOLERANCE, make_paged_batch


@pytest.mark.parametrize("native", [True, False], ids=["cpp-decode", "sdpa-decode"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch_matches_reference(
    monkeypatch: pytest.MonkeyPatch, native: bool, dtype: torch.dtype, group: int, block_size: int
) -> None:
    if native:
        assert cpu_kernels() is not None, "the C++ CPU kernels failed to build"
    else:
        monkeypatch.setattr(paged_attention_cpu_module, "cpu_kernels", lambda: None)
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
    tol = TOLERANCE[dtype]
    got = paged_attention_cpu(*batch.args(), scale)
    if native:  # decode-only batches take the kernel's in-order fast path
        decode_only = make_paged_batch([1] * num_decodes, decode_lens, num_heads=2 * group, num_kv_heads=2,
                                       head_dim=64, block_size=block_size, dtype=dtype)
        torch.testing.assert_close(paged_attention_cpu(*decode_only.args(), scale).float(),
                                   paged_attention_ref(*decode_only.args(), scale).float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
