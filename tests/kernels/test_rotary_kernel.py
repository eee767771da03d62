"""Triton rotary embedding (neox and GPT-J layouts, full and partial rotation) against the reference."""

from __future__ import annotations

import pytest
import torch

from kvforge.kernels.rotary import rotary_embedding_ref, rotary_embedding_triton

# Measured: fp32 and fp16 exact, bf16 <= 1 ulp (the interpreter truncates fp32 -> bf16).
TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1.6e-2}


def cos_sin_cache(max_position: int, rot_dim: int, base: float = 500000.0) -> torch.Tensor:
    """[max_position, rot_dim] fp32: cos of every frequency, then sin."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    angles = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize(("head_dim", "rot_dim"), [(64, 64), (80, 32)])
def test_rotary(device: torch.device, dtype: torch.dtype, is_neox: bool, head_dim: int, rot_dim: int) -> None:
    num_tokens = 11
    positions = torch.randint(0, 8192, (num_tokens,), device=device)
    query = torch.randn(num_tokens, 8, head_dim).to(device, dtype)
    key = torch.randn(num_tokens, 2, head_dim).to(device, dtype)
    cache = cos_sin_cache(8192, rot_dim).to(device)
    query_out = torch.full_like(query, float("nan"))
    key_out = torch.full_like(key, float("nan"))
    rotary_embedding_triton(positions, query, key, cache, is_neox, query_out=query_out, key_out=key_out)
    expected_q, expected_k = rotary_embedding_ref(positions, query, key, cache, is_neox)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(query_out, expected_q, atol=tol, rtol=tol)
    torch.testing.assert_close(key_out, expected_k, atol=tol, rtol=tol)


def test_strided_query_and_key(device: torch.device) -> None:
    """query and key as views into one fused qkv projection output, as the model produces them."""
    qkv = torch.randn(5, (4 + 2 + 2) * 64, device=device)
    query = qkv[:, : 4 * 64].view(5, 4, 64)
    key = qkv[:, 4 * 64 : 6 * 64].view(5, 2, 64)
    positions = torch.arange(5, device=device) + 100
    cache = cos_sin_cache(512, 64).to(device)
    got = rotary_embedding_triton(positions, query, key, cache, True)
    expected = rotary_embedding_ref(positions, query, key, cache, True)
    torch.testing.assert_close(got, expected)


def test_rejects_odd_rot_dim(device: torch.device) -> None:
    query = torch.randn(2, 4, 64, device=device)
    with pytest.raises(ValueError, match="rot_dim"):
        rotary_embedding_triton(
            torch.zeros(2, dtype=torch.long, device=device),
            query,
            query,
            torch.randn(16, 33, device=device),
            True,
        )
