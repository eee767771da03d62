"""Float32 linear layers on the CPU: the C++ GEMV of csrc/dense_gemv.cpp for a few rows, oneDNN's matmul above.

Up to DENSE_GEMV_MAX_TOKENS rows of x, the kernel streams the row-major weight with prefetching; above them
(batched decode, prefill) oneDNN's matmul (`kvforge_cpu::onednn_linear`, the op torch's own compiled CPU graphs
call) on a copy of the weight packed at load in oneDNN's blocked layout: on the row-major weight, oneDNN repacks it
on every call. F.linear (torch's BLAS) is the reference both are tested against, and the path where torch has no
oneDNN. Over the default model's 30 layers, float32 weights streamed from memory, ms per pass, and its 49152-row LM
head (`python -m kvforge.benchmarks.quant_gemv_cpu --threads 2 --tokens 1,2,4,8,16,64 --rounds 7`, Zen 4 EPYC VM,
2 threads, fastest of 7 rounds, the variants taking turns):

    rows of x                 1     2     4     8    16    64
    layers  F.linear       37.1  72.1  52.8  46.2  58.6   180
            GEMV           19.7  20.9  22.9  28.8  43.4   155
            oneDNN         26.2  30.6  33.2  36.0  40.8   120
            oneDNN packed  24.4  26.0  24.2  23.0  29.1  86.6
    head    F.linear        9.7  23.4  21.0  19.1  22.2  51.3
            GEMV            5.2   4.9   5.7   7.4  10.8  39.9
            oneDNN          4.9   5.5   6.9   7.9  11.0  26.0
            oneDNN packed   4.9   5.3   4.8   5.4   6.8  19.9

The compiled decode buckets are 1, 2, 4, 8, 16, ..., so buckets up to 4 take the GEMV and the larger ones oneDNN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.kernels.cpu.half_gemv import HALF_DTYPES, half_linear
from kvforge.kernels.cpu.quant_gemv import native_kernels_available

DENSE_GEMV_MAX_TOKENS = 4  # rows of x up to which the kernel beats oneDNN on the packed weight
ONEDNN = torch.backends.mkldnn.is_available()  # this torch build has oneDNN (read once: tracing skips the call)
ONEDNN_PACK_ROWS = 64  # the rows of x oneDNN is told to expect when it picks the packed layout


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemv: bool,
                 packed: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); with gemv (a float32 CPU layer whose extension is built, decided at load), a few
    rows of x go through the C++ GEMV and more through oneDNN, where torch has it: on packed, the weight in
    oneDNN's blocked layout (`pack_for_onednn`), else on the row-major weight. A weight kept in 16 bits (a GGUF
    file's F16 and BF16 matrices) goes to half_gemv.py's half_linear."""
    if weight.dtype != x.dtype and weight.dtype in HALF_DTYPES:
        return half_linear(x, weight, bias, gemv)
    if gemv and x.dim() == 2 and x.dtype == torch.float32:  # NOTE: a model run in 16 bits keeps F.linear
        if x.shape[0] <= DENSE_GEMV_MAX_TOKENS:
            out = torch.ops.kvforge_cpu.dense_gemv(x, weight)
            return out if bias is None else out + bias
        if ONEDNN:
            return torch.ops.kvforge_cpu.onednn_linear(x, weight if packed is None else packed, bias)
    return F.linear(x, weight, bias)


# The activations oneDNN applies to a matmul's output as a post-op (eltwise attr, algorithm), by the names
# Linear.forward_fused takes (layers/linear.py has the functions they stand for).
ONEDNN_ACTIVATIONS = {"gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh"), "relu": ("relu", None)}


def onednn_linear_fused(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                        activation: str) -> torch.Tensor:
    """activation(x W^T + b) in one oneDNN call on the packed weight: the post-op is applied to each output block
    while it is in cache, instead of in another pass over the whole output.
    NOTE: mkldnn::_linear_pointwise itself, not the opaque onednn_linear: only eager steps call this."""
    attr, algorithm = ONEDNN_ACTIVATIONS[activation]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, attr, [], algorithm)


def pack_for_onednn(weight: torch.Tensor) -> torch.Tensor:
    """A copy of weight [N, K] in the blocked layout oneDNN's matmul reads best (an opaque oneDNN tensor of shape
    [N, K]): unpacked, the matmul repacks its weight on every call."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ONEDNN_PACK_ROWS)


def use_dense_gemv(model: nn.Module) -> None:
    """Route the rows of the model's float32 CPU layers (a float Linear's kernel, the float LM head: modules with
    `dense_gemv` and `onednn_weight` attributes) through the GEMV and oneDNN, where the AVX2 extension is built;
    elsewhere they keep F.linear. Those whose weight is kept in 16 bits take half_gemv.py's GEMV, and get no packed
    copy. NOTE: the packed copy of each float32 weight is memory beside the weight itself (the GEMV reads the row-major
    one): it doubles a float32 model's weights, for 1.4-1.6x faster layers at 8-64 rows (table above).
    Code that later writes a weight in place calls `drop_packed_weights` first."""
    layers = [module for module in model.modules() if hasattr(module, "dense_gemv") and _fits(module)]
    heads = {id(module.lm_head) for module in model.modules() if getattr(module, "lm_head", None) is not None}
    if layers and native_kernels_available():  # NOTE: only then, so that a GPU model never builds the extension
        for module in layers:
            module.dense_gemv = True
            multiplies = not hasattr(module, "compute_logits") or id(module) in heads  # not an untied input table
            packs = ONEDNN and multiplies and module.weight.dtype == torch.float32  # not a weight kept in 16 bits
            module.onednn_weight = pack_for_onednn(module.weight) if packs else None


def drop_packed_weights(model: nn.Module) -> None:
    """Before code that writes the model's weights in place (the quantization tools): the layers then multiply by
    their row-major weights, so the new values count (a packed copy would keep the old ones)."""
    for module in model.modules():
        if getattr(module, "onednn_weight", None) is not None:
            module.onednn_weight = None


def _fits(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (isinstance(weight, torch.Tensor) and weight.dtype in (torch.float32, *HALF_DTYPES)
            and weight.device.type == "cpu"
            and weight.dim() == 2 and weight.is_contiguous())
