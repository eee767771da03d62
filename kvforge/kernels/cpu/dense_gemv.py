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

DENSE_GEMV_MAX_TOKENS = 3  # rows of x up to which the kernel beats oneDNN on the packed weight
ONEDNN = torch.backends.mkldnn.is_available()  # this torch build has oneDNN (read once: tracing skips the call)
ONEDNN_PACK_ROWS = 64  # the rows of x oneDNN is told to expect when it picks the packed layout


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemv: bool,
                 packed: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); with gemv (a float32 CPU layer whose extension is built, decided at load), a few
    rows of x go through the C++ GEMV and more through oneDNN, where torch has it: on packed, the weight in
    oneDNN's blocked layout (`pack_for_onednn`), else on the row-major weight."""
    if gemv and x.dim() == 2:
        if x.shape[0] <= DENSE_GEMV_MAX_TOKENS:
            out = torch.ops.kvforge_cpu.dense_gemv(x, weight)
            return out if bias is None else out + bias
        if ONEDNN:
            return torch.ops.kvforge_cpu.onednn_linear(x, weight if packed is None else packed, bias)
    return F.linear(x, weight, bias)


def pack_for_onednn(weight: torch.Tensor) -> torch.Tensor:
    """A copy of weight [N, K] in the blocked layout oneDNN's matmul reads best (an opaque oneDNN tensor of shape
    [N, K]): unpacked, the matmul repacks its weight on every call."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ONEDNN_PACK_ROWS)


def use_dense_gemv(model: nn.Module) -> None:
    """Route the rows of the model's float32 CPU layers (Linear, the float LM head: modules with `dense_gemv` and
    `onednn_weight` attributes) through the GEMV and oneDNN, where the AVX2 extension is built; elsewhere they keep
    F.linear. NOTE: the packed copy of each weight is memory beside the weight itself (the GEMV reads the
    row-major one): it doubles a float32 model's weights, for 1.3-1.8x faster layers at 4-64 rows."""
    layers = [module for module in model.modules() if hasattr(module, "dense_gemv") and _fits(module)]
    if layers and native_kernels_available():  # NOTE: only then, so that a GPU model never builds the extension
        for module in layers:
            module.dense_gemv = True
            module.onednn_weight = pack_for_onednn(module.weight) if ONEDNN else None


def _fits(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (isinstance(weight, torch.Tensor) and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.dim() == 2 and weight.is_contiguous())
