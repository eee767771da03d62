"""RMSNorm, optionally fused with the residual add."""

from __future__ import annotations

import torch

from kvforge.kernels.triton_compat import jit, next_power_of_2, require_triton, tl
from kvforge.kernels.tuning import kernel_tuning
from kvforge.kernels.validation import FLOAT_DTYPES, check_matches, check_same_device, check_tensor
from kvforge.platforms import Platform


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """out = x / sqrt(mean(x^2) + eps) * weight, computed in fp32.  x: [num_tokens, hidden]."""
    x32 = x.float()
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    return (x32 * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual')."""
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps), new_residual


@jit
def _rms_norm_kernel(
    out_ptr, residual_out_ptr, x_ptr, residual_ptr, weight_ptr, eps, hidden, stride_x, stride_r,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One row per program; outputs are contiguous. Rounds where the reference rounds: the residual
    sum to the input dtype, the normalised row to the input dtype before the weight multiply."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * hidden + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, 0) / hidden + eps)
    normed = (x32 * inv_rms).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    residual_out: torch.Tensor | None,
    platform: Platform | None,
) -> None:
    """x, residual: [..., hidden]; out, residual_out: contiguous buffers of x's shape; platform: whose tuning table
    (None: the current platform's)."""
    require_triton()
    if x.dim() == 0:
        raise ValueError("x must have a hidden dim, got a 0-d tensor")
    hidden = x.shape[-1]
    check_tensor("x", x, shape=(None,) * x.dim(), dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, shape=(hidden,), dtypes=FLOAT_DTYPES)
    check_same_device(x=x, weight=weight)
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    check_matches("out", out, shape=x.shape, dtype=out_dtype, device=x.device, contiguous=True)
    if residual is not None:
        check_same_device(x=x, residual=residual)
        check_matches(
            "residual_out", residual_out, shape=x.shape, dtype=x.dtype, device=x.device, contiguous=True
        )
    x = x.reshape(-1, hidden)
    # NOTE: without a residual the kernel touches neither residual_in nor residual_out.
    residual_in = x if residual is None else residual.reshape(-1, hidden)
    residual_out = out if residual is None else residual_out
    if x.shape[0] == 0:
        return
    block = next_power_of_2(hidden)
    _rms_norm_kernel[(x.shape[0],)](
        out, residual_out, x, residual_in, weight, eps, hidden, x.stride(0), residual_in.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=kernel_tuning(platform).rows.num_warps(block),
    )  # fmt: skip


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None,
    platform: Platform | None = None,
) -> torch.Tensor:
    """rms_norm_ref in Triton, one program per token. x: [..., hidden]; out: optional output buffer."""
    if out is None:
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _launch(x, None, weight, eps, out, None, platform)
    return out


def fused_add_rms_norm_triton(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    platform: Platform | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_add_rms_norm_ref in Triton: one pass reads x and residual and writes both outputs."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual must match x {tuple(x.shape)} {x.dtype}, got {tuple(residual.shape)} {residual.dtype}"
        )
    if out is None:
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if residual_out is None:
        residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, residual, weight, eps, out, residual_out, platform)
    return out, residual_out
