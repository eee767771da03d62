"""RMSNorm, LayerNorm, SiLU-and-mul and rotary embedding on the CPU: the C++ kernels (csrc/layer_ops.cpp,
csrc/layer_norm.cpp) in eager steps, the torch references while torch.compile traces.

Eagerly, each reference is 4-6 torch ops, each a pass over memory into a fresh temporary; the kernel is one pass.
Traced, the reference is what Inductor fuses into the loops around it, which an opaque op would only split. Same
contracts as the references (kernels/rms_norm.py, layer_norm.py, activation.py, rotary.py); inputs the kernels do
not take (a weight in another dtype than x, rows without a unit stride) go to the reference.
"""

from __future__ import annotations

import torch

from kvforge.kernels.activation import silu_and_mul_ref
from kvforge.kernels.layer_norm import layer_norm_ref
from kvforge.kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_ref
from kvforge.kernels.rotary import rotary_embedding_ref

Tensor = torch.Tensor


def _eager_rows(x: Tensor) -> bool:
    """x is run by a kernel: not traced, on the CPU, and its rows have at least one element.

    NOTE: not torch.compiler.is_compiling(), one flag for the whole process while any thread compiles: an eager
    step beside a compile in the background would run the references."""
    return not torch.compiler.is_dynamo_compiling() and x.is_cpu and x.dim() >= 1 and x.shape[-1] > 0


def rms_norm_cpu(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if not _eager_rows(x) or weight.dtype != x.dtype:
        return rms_norm_ref(x, weight, eps)
    return torch.ops.kvforge_cpu.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


def fused_add_rms_norm_cpu(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    if not _eager_rows(x) or weight.dtype != x.dtype or residual.dtype != x.dtype or residual.shape != x.shape:
        return fused_add_rms_norm_ref(x, residual, weight, eps)
    hidden = x.shape[-1]
    out, new_residual = torch.ops.kvforge_cpu.fused_add_rms_norm(
        x.reshape(-1, hidden), residual.reshape(-1, hidden), weight, eps)
    return out.view(x.shape), new_residual.view(x.shape)


def layer_norm_cpu(x: Tensor, weight: Tensor, bias: Tensor, eps: float, residual: Tensor | None = None) -> Tensor:
    """float32 rows only: the encoders that call it run in float32, and the kernel computes in it."""
    if (not _eager_rows(x) or x.dtype != torch.float32 or weight.dtype != x.dtype or bias.dtype != x.dtype
            or x.stride(-1) != 1 or (residual is not None and (residual.dtype != x.dtype or residual.shape != x.shape
                                                               or residual.stride(-1) != 1))):
        return layer_norm_ref(x, weight, bias, eps, residual)
    hidden = x.shape[-1]
    rows = None if residual is None else residual.reshape(-1, hidden)
    return torch.ops.kvforge_cpu.layer_norm(x.reshape(-1, hidden), rows, weight, bias, eps).view(x.shape)


def silu_and_mul_cpu(x: Tensor) -> Tensor:
    if not _eager_rows(x) or x.shape[-1] % 2:
        return silu_and_mul_ref(x)
    return torch.ops.kvforge_cpu.silu_and_mul(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], x.shape[-1] // 2)


def rotary_embedding_cpu(positions: Tensor, query: Tensor, key: Tensor, cos_sin_cache: Tensor, is_neox: bool
                         ) -> tuple[Tensor, Tensor]:
    if (not _eager_rows(query) or query.dim() != 3 or key.dim() != 3 or query.stride(-1) != 1 or key.stride(-1) != 1
            or key.dtype != query.dtype or cos_sin_cache.dtype != torch.float32):
        return rotary_embedding_ref(positions, query, key, cos_sin_cache, is_neox)
    return torch.ops.kvforge_cpu.rotary_embedding(positions.reshape(-1), query, key, cos_sin_cache.contiguous(),
                                                  is_neox)
