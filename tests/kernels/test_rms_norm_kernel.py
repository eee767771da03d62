"""Triton RMSNorm (plain and fused with the residual add) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from kvforge.kernels.rms_norm import (
    fused_add_rms_norm_ref,
    fused_add_rms_norm_triton,
    rms_norm_ref,
    rms_norm_triton,
)

# Measured on unit-normal rows: fp32 <= 2e-6; fp16 <= 2 ulp and bf16 <= 4 ulp, rounding flips of the
# normalised row carried through the weight multiply (the interpreter truncates fp32 -> bf16).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 3.2e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def nan_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.full(t.shape, float("nan"), dtype=dtype or t.dtype, device=t.device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 100), (2, 3, 4096)])
def test_rms_norm(device: torch.device, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = (3 * torch.randn(shape)).to(device, dtype)
    weight = torch.randn(shape[-1]).to(device, dtype)
    out = rms_norm_triton(x, weight, 1e-6, out=nan_like(x))
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-6), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(device: torch.device, dtype: torch.dtype) -> None:
    x = torch.randn(9, 300).to(device, dtype)
    residual = torch.randn(9, 300).to(device, dtype)
    weight = torch.randn(300).to(device, dtype)
    out, new_residual = fused_add_rms_norm_triton(
        x, residual, weight, 1e-5, out=nan_like(x), residual_out=nan_like(x)
    )
    expected_out, expected_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(new_residual, expected_residual, atol=tol, rtol=tol)
    torch.testing.assert_close(out, expected_out, atol=tol, rtol=tol)


def test_fp32_weight_promotes_output(device: torch.device) -> None:
    """bf16 activations with an fp32 weight give fp32 outputs, as in the reference."""
    x = torch.randn(4, 128).to(device, torch.bfloat16)
    weight = torch.randn(128, device=device)
    out = rms_norm_triton(x, weight, 1e-6)
    expected = rms_norm_ref(x, weight, 1e-6)
    assert out.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=3e-2, rtol=1.6e-2)


def test_non_contiguous_rows(device: torch.device) -> None:
    x = torch.randn(6, 2, 64, device=device)[:, 0]  # row stride 128
    weight = torch.randn(64, device=device)
    torch.testing.assert_close(rms_norm_triton(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))


def test_rejects_bad_inputs(device: torch.device) -> None:
    x = torch.randn(4, 64, device=device)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x, torch.ones(32, device=device), 1e-6)
    with pytest.raises(ValueError, match="eps"):
        rms_norm_triton(x, torch.ones(64, device=device), 0.0)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm_triton(x, x[:2], torch.ones(64, device=device), 1e-6)
    with pytest.raises(ValueError, match="dtype"):
        rms_norm_triton(x.long(), torch.ones(64, device=device), 1e-6)
