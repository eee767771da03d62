"""Float32 linear layers with bfloat16 products on the CPU (csrc/bf16_gemm.cpp): x and the weight rounded to bfloat16
(the weight once, at load, into the layout AMX's tiles load), the products summed in float32, the bias and the
activation applied to each output block while it is in cache; x and the output stay float32.

The encoder models' option `bf16_matmuls` (config.py) turns it on per engine: a layer whose kernel holds a packed
weight (`use_bf16_matmuls`, at load) multiplies through it, every other layer, and every other engine in the
process, keeps its float32 matmul. Nothing global is set: torch's own switch for this
(torch.backends.mkldnn.matmul.fp32_precision = "bf16") is one for the whole process.

Over float32 (oneDNN on its packed weight), all-MiniLM-L6-v2's matmuls of a 64-sentence batch (1920 rows) take
2.5-3.4x less CPU time (one thread, the two taking turns, on a busy Sapphire Rapids VM). The error is that of x and
the weight rounded to bfloat16 (a relative 2^-9 each), not of a bfloat16 output: the embeddings keep a cosine of
0.9999 or more to float32 ones (tests/pooling/test_embed.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge.kernels.cpu.extension import cpu_kernels

# The activations the kernel applies after the bias, by the names Linear.forward_fused takes (layers/linear.py), as
# csrc/bf16_gemm.cpp numbers them; 0 is none.
BF16_ACTIVATIONS = {"gelu": 1, "gelu_tanh": 2, "relu": 3}
BF16_BLOCK = 32  # the weight's rows and columns come in whole blocks of this many


def bf16_matmuls_supported() -> bool:
    """The kernels are built with the AMX code and this CPU runs it (AMX-BF16, and Linux lets the process use the
    tile registers)."""
    return cpu_kernels() is not None and torch.ops.kvforge_cpu.bf16_gemm_supported()


def bf16_weight_fits(weight: torch.Tensor) -> bool:
    """A float32 CPU weight [N, K] whose N and K are whole blocks."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[0] % BF16_BLOCK == 0 and weight.shape[1] % BF16_BLOCK == 0)


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float32 rounded to bfloat16 and packed for bf16_linear: [N / 16, K / 32, 16, 32]. Like
    bf16_linear, only where bf16_matmuls_supported() (which loads the kernels) has said yes."""
    return torch.ops.kvforge_cpu.bf16_gemm_pack(weight.detach())


def bf16_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                activation: str | None = None) -> torch.Tensor:
    """activation(x W^T + b) for float32 rows x [M, K] (unit column stride) and W packed by pack_bf16: [M, N] float32.
    """
    code = 0 if activation is None else BF16_ACTIVATIONS[activation]
    return torch.ops.kvforge_cpu.bf16_gemm(x, packed, bias, code)


def bf16_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The reference: torch's float32 matmul of x and the weight rounded to bfloat16 (to nearest even)."""
    return F.linear(x.bfloat16().float(), weight.bfloat16().float(), bias)


def use_bf16_matmuls(model: torch.nn.Module) -> int:
    """Give each float32 layer kernel of the model (modules with a `bf16_weight` attribute) whose weight fits its
    weight packed for bf16_linear, which its multiplies then take; their oneDNN copies (`onednn_weight`) go. Returns
    how many layers it packed. The caller checks bf16_matmuls_supported() first."""
    layers = [module for module in model.modules()
              if hasattr(module, "bf16_weight") and isinstance(getattr(module, "weight", None), torch.Tensor)
              and bf16_weight_fits(module.weight)]
    for module in layers:
        module.bf16_weight = pack_bf16(module.weight)
        module.onednn_weight = None
    return len(layers)
