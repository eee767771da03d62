"""Float32 linear layers on the CPU: the C++ GEMV of csrc/dense_gemv.cpp for a few rows, oneDNN's matmul above.

Up to DENSE_GEMV_MAX_TOKENS rows of x, the kernel streams the row-major weight with prefetching; above them
(batched decode, prefill) oneDNN's matmul on the same weight (`kvforge_cpu::onednn_linear`, the op torch's own
compiled CPU graphs call). F.linear (torch's BLAS) is the reference both are tested against, and the path where
torch has no oneDNN. Over the default model's 30 layers, float32 weights streamed from memory, ms per pass, and its
49152-row LM head (Zen 4 EPYC VM, 2 threads, fastest of 4-7 rounds, the three taking turns):

    rows of x            1     2     4     8    16    32    64   128
    layers  F.linear  35.6  54.6  46.5  44.1  50.5  72.4   108   179
            GEMV      17.0  17.7  19.4  30.1  42.6  72.6   130   240
            oneDNN    21.3  22.6  25.6  30.9  38.4  55.3  88.8   156
    head    F.linear   9.6  21.4  16.1  15.8  18.9  26.4  35.1  61.8
            GEMV       4.3   4.6   5.3   7.7  10.3  18.2  31.6  59.5
            oneDNN     4.3   5.2   6.0   7.5   9.1  14.2  23.2  38.0

(the last two rows hold for prefill chunks too: 512 rows of each layer shape, oneDNN 1.04-1.32x F.linear). The
compiled decode buckets are 1, 2, 4, 8, 16, ..., so buckets up to 8 take the GEMV and the larger ones oneDNN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.kernels.cpu.quant_gemv import native_kernels_available

DENSE_GEMV_MAX_TOKENS = 8  # rows of x up to which the kernel beats oneDNN
ONEDNN = torch.backends.mkldnn.is_available()  # this torch build has oneDNN (read once: tracing skips the call)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemv: bool) -> torch.Tensor:
    """F.linear(x, weight, bias); with gemv (a float32 CPU layer whose extension is built, decided at load), a few
    rows of x go through the C++ GEMV and more through oneDNN, where torch has it."""
    if gemv and x.dim() == 2:
        if x.shape[0] <= DENSE_GEMV_MAX_TOKENS:
            out = torch.ops.kvforge_cpu.dense_gemv(x, weight)
            return out if bias is None else out + bias
        if ONEDNN:
            return torch.ops.kvforge_cpu.onednn_linear(x, weight, bias)
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
