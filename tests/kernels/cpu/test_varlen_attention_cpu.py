"""The CPU kernel of a pooling step's attention (csrc/varlen_attention.cpp): each sequence of a packed batch attended
within itself, against torch's scaled_dot_product_attention run on each sequence alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvforge.kernels.cpu.extension import cpu_kernels

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _built() -> None:
    assert cpu_kernels() is not None, "the C++ CPU kernels failed to build"


def _per_sequence(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lens: list[int],
                  causal: bool) -> torch.Tensor:
    out, start = [], 0
    for length in lens:
        q, k, v = (t[start : start + length].float().transpose(0, 1)[None] for t in (query, key, value))
        out.append(F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)[0].transpose(0, 1))
        start += length
    return torch.cat(out)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "dtype"), [
    (12, 12, 32, torch.float32),  # all-MiniLM-L6-v2's
    (8, 2, 40, torch.float32),  # grouped heads, a head dim that is no multiple of 16
    (6, 3, 17, torch.float32),
    (4, 4, 64, torch.bfloat16),
])
def test_packed_sequences_match_each_alone(causal, num_heads, num_kv_heads, head_dim, dtype):
    torch.manual_seed(0)
    lens = [1, 2, 17, 33, 16, 130, 5]  # one token, tile edges (16, 17, 33) and one past 128
    num_tokens = sum(lens)
    # q, k and v as views of one projection's output, as the models pass them (rows strided, read in place)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    query, key, value = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    query = query.view(num_tokens, num_heads, head_dim)
    key, value = (t.view(num_tokens, num_kv_heads, head_dim) for t in (key, value))
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    out = torch.ops.kvforge_cpu.varlen_attention(query, key, value, starts, head_dim**-0.5, causal)
    assert out.shape == query.shape and out.dtype == dtype and out.is_contiguous()
    expected = _per_sequence(query, key, value, lens, causal)
    assert (out.float() - expected).abs().max().item() <= TOLERANCE[dtype]


def test_rejects_query_start_loc_that_does_not_cover_the_tokens():
    query = torch.randn(5, 2, 16)
    with pytest.raises(RuntimeError, match="query_start_loc runs from 0 to the number of tokens"):
        torch.ops.kvforge_cpu.varlen_attention(query, query, query, torch.tensor([0, 3]), 0.25, False)
