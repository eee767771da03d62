"""SiLU-and-multiply: the gated activation of Llama-style MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge.kernels.triton_compat import cdiv, jit, next_power_of_2, require_triton, tl
from kvforge.kernels.tuning import kernel_tuning
from kvforge.kernels.validation import FLOAT_DTYPES, check_matches, check_tensor
from kvforge.platforms import Platform


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * d] holding [gate | up]; returns silu(gate) * up: [num_tokens, d]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@jit
def _silu_and_mul_kernel(out_ptr, x_ptr, d, stride_x, stride_o, BLOCK: tl.constexpr):
    """Grid (tokens, column blocks). Computed in fp32, rounded once."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor, *, out: torch.Tensor | None = None,
                        platform: Platform | None = None) -> torch.Tensor:
    """silu_and_mul_ref in Triton. x: [..., 2 * d]; out: optional contiguous [..., d] buffer; platform: whose tuning
    table (None: the current platform's)."""
    require_triton()
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"x must be [..., 2 * d], got {tuple(x.shape)}")
    check_tensor("x", x, shape=(None,) * x.dim(), dtypes=FLOAT_DTYPES)
    d = x.shape[-1] // 2
    out_shape = (*x.shape[:-1], d)
    if out is None:
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    check_matches("out", out, shape=torch.Size(out_shape), dtype=x.dtype, device=x.device, contiguous=True)
    rows = x.reshape(-1, 2 * d)
    if rows.shape[0] == 0 or d == 0:
        return out
    block = min(next_power_of_2(d), kernel_tuning(platform).rows.activation_block)
    _silu_and_mul_kernel[(rows.shape[0], cdiv(d, block))](
        out, rows, d, rows.stride(0), d, BLOCK=block, num_warps=kernel_tuning(platform).rows.num_warps(block)
    )
    return out
