"""Triton reshape_and_cache against the torch reference: every cache element, written or not."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvforge.kernels.cache_write import reshape_and_cache_ref, reshape_and_cache_triton


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float16),
    ],
)
@pytest.mark.parametrize("block_size", [16, 32])
def test_reshape_and_cache(
    device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype, block_size: int
) -> None:
    num_blocks, num_kv_heads, head_dim = 6, 3, 40
    key = torch.randn(7, num_kv_heads, head_dim).to(device, dtype)
    value = torch.randn(7, num_kv_heads, head_dim).to(device, dtype)
    # scattered slots, one negative (padding: skipped), the last slot of the cache included
    slots = torch.tensor(
        [5, block_size, -1, 3 * block_size + 7, 2 * block_size - 1, 1, num_blocks * block_size - 1]
    )
    caches = [
        torch.full(
            (num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=cache_dtype, device=device
        )
        for _ in range(4)
    ]
    reshape_and_cache_triton(key, value, caches[0], caches[1], slots.to(device))
    reshape_and_cache_ref(key, value, caches[2], caches[3], slots.to(device))
    torch.testing.assert_close(caches[0], caches[2], atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(caches[1], caches[3], atol=0, rtol=0, equal_nan=True)
    assert int(caches[0].isnan().any(-1).any(-1).sum()) == num_blocks * block_size - 6


@pytest.mark.parametrize("write", [reshape_and_cache_ref, reshape_and_cache_triton])
def test_strided_cache_and_inputs(device: torch.device, write: Callable[..., None]) -> None:
    """K and V caches as halves of one tensor; key and value as views into a fused qkv output."""
    kv = torch.full((4, 2, 16, 2, 32), float("nan"), device=device)
    qkv = torch.randn(3, (4 + 2 + 2) * 32, device=device)
    key = qkv[:, 4 * 32 : 6 * 32].view(3, 2, 32)
    value = qkv[:, 6 * 32 :].view(3, 2, 32)
    slots = torch.tensor([0, 17, 63], device=device, dtype=torch.int32)
    write(key, value, kv[:, 0], kv[:, 1], slots)
    torch.testing.assert_close(kv[:, 0].flatten(0, 1)[slots.long()], key)
    torch.testing.assert_close(kv[:, 1].flatten(0, 1)[slots.long()], value)
    assert int(kv.isnan().any(-1).any(-1).sum()) == 4 * 2 * 16 - 6


def test_rejects_mismatched_shapes(device: torch.device) -> None:
    cache = torch.zeros(2, 16, 2, 32, device=device)
    key = torch.randn(3, 2, 32, device=device)
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache_triton(key, key, cache, cache, torch.zeros(2, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="key"):
        reshape_and_cache_triton(
            key[:, :1], key, cache, cache, torch.zeros(3, dtype=torch.long, device=device)
        )
