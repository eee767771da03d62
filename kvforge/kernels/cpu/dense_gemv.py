"""Float32 linear layers at decode sizes on the CPU: the C++ GEMV of csrc/dense_gemv.cpp, F.linear above it.

Up to DENSE_GEMV_MAX_TOKENS rows of x, the kernel streams the row-major weight with prefetching; F.linear is the
reference it is tested against and the path for larger batches (prefill, which is compute-bound). Over the
default model's 30 layers, weights streamed from memory (AVX2 EPYC, 2 threads, `python -m
kvforge.benchmarks.quant_gemv_cpu --threads 2 --tokens 1,16`): 1.7x F.linear at one row, 1.8x at 16; a one-off
run of 1 to 32 rows had it ahead all the way (1.15x at 32), hence the bound.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.kernels.cpu.quant_gemv import native_kernels_available

DENSE_GEMV_MAX_TOKENS = 32  # rows of x up to which the kernel beats F.linear


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemv: bool) -> torch.Tensor:
    """F.linear(x, weight, bias); with gemv (a float32 CPU layer whose extension is built, decided at load), a few
    rows of x go through the C++ GEMV."""
    if gemv and x.dim() == 2 and x.shape[0] <= DENSE_GEMV_MAX_TOKENS:
        out = torch.ops.kvforge_cpu.dense_gemv(x, weight)
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


def use_dense_gemv(model: nn.Module) -> None:
    """Route the decode rows of the model's float32 CPU layers (Linear, the float LM head: modules with a
    `dense_gemv` flag) through the GEMV, where the AVX2 extension is built; elsewhere they keep F.linear."""
    layers = [module for module in model.modules() if hasattr(module, "dense_gemv") and _fits(module)]
    if layers and native_kernels_available():  # NOTE: only then, so that a GPU model never builds the extension
        for module in layers:
            module.dense_gemv = True


def _fits(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (isinstance(weight, torch.Tensor) and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.dim() == 2 and weight.is_contiguous())
