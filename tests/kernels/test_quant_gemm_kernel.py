"""Quantized GEMM kernels (W4A16/W8A16 dequantize-and-multiply, W8A8 int8) against their references."""

from __future__ import annotations

import pytest
import torch

from kvforge.kernels.int8_gemm import int8_gemm_ref, int8_gemm_triton, quantize_per_token_ref
from kvforge.kernels.quant_gemm import pack_codes, quant_gemm_ref, quant_gemm_triton, unpack_codes


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    "num_tokens,out_features,in_features,group_size",
    [(1, 40, 64, 32), (3, 96, 128, 128), (17, 70, 96, 32), (33, 16, 256, 64), (2, 40, 96, 48), (5, 33, 48, 24)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quant_gemm_matches_reference(
    device: torch.device,
    bits: int,
    num_tokens: int,
    out_features: int,
    in_features: int,
    group_size: int,
    dtype: torch.dtype,
) -> None:
    codes = torch.randint(0, 2**bits, (out_features, in_features), device=device)
    qweight = pack_codes(codes, bits)
    assert torch.equal(unpack_codes(qweight, bits), codes.to(torch.uint8))
    num_groups = in_features // group_size
    scales = (torch.rand(out_features, num_groups, device=device) * 0.1).to(dtype)
    zeros = torch.randint(0, 2**bits, (out_features, num_groups), device=device).to(dtype)
    x = torch.randn(num_tokens, in_features, device=device, dtype=dtype)
    expected = quant_gemm_ref(x, qweight, scales, zeros, bits)
    got = quant_gemm_triton(x, qweight, scales, zeros, bits)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        got.float(), expected.float(), rtol=tol, atol=tol * expected.abs().max().item()
    )


def test_quant_gemm_rejects_a_bad_qweight(device: torch.device) -> None:
    x = torch.randn(2, 64, device=device)
    scales = torch.ones(8, 2, device=device)
    with pytest.raises(ValueError, match="qweight"):
        quant_gemm_triton(x, torch.zeros(8, 64, dtype=torch.uint8, device=device), scales, scales, 4)


@pytest.mark.parametrize("num_tokens,out_features,in_features", [(1, 24, 64), (5, 33, 100), (40, 64, 160)])
def test_int8_gemm_matches_reference_exactly(
    device: torch.device, num_tokens: int, out_features: int, in_features: int
) -> None:
    x = torch.randn(num_tokens, in_features, device=device)
    a, a_scales = quantize_per_token_ref(x)
    b = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, device=device)
    b_scales = torch.rand(out_features, device=device)
    expected = int8_gemm_ref(a.cpu(), b.cpu(), a_scales.cpu(), b_scales.cpu(), torch.float32)
    got = int8_gemm_triton(a, b, a_scales, b_scales, torch.float32)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(
        a.float() * a_scales[:, None], x, rtol=0, atol=x.abs().max().item() / 254 + 1e-6
    )
