"""Many rows of x against a panel-layout weight (quant_panels.py) on a CPU that multiplies bfloat16 in hardware
(AVX-512 BF16, AMX): the weight unpacked to bfloat16 (csrc/panel_unpack.cpp) into one buffer of the model's reused
from layer to layer, then torch's bfloat16 GEMM (oneDNN), as the BF16 GGUF files run (half_gemv.py).

    unpack   weight -> W^T [K, N] bfloat16, each 16 rows' column one conversion and one multiply-add of a vector of
             the layout (thread t the panels of part t): about the time of a copy of the bfloat16 bytes it writes
    GEMM     x rounded to bfloat16 times W^T, the product rounded to bfloat16 (as half_gemv.py's bfloat16 GEMM)

Above a few dozen rows this is several times the int8 panel kernel (which unpacks the codes again for each 4 rows of
x, and whose vpdpbusd does 16 x 4 products an instruction where AMX does 16 x 32 x 16); below, unpacking the whole
weight costs more than it saves. A weight goes this way where `unpacks` says so (the CPU, its size), a call where
`takes_rows` does (its rows); elsewhere (AVX-512 CPUs without BF16, small row counts, a compiled graph) the int8
panel kernel runs.

Numerics: x and W rounded to bfloat16 (2^-9 of each), float32 sums, the product rounded to bfloat16 (2^-9 of it):
about 2e-3 of a layer's output, within the bound the int8 path is held to (x rounded to 8 bits per 32 columns).
"""

from __future__ import annotations

import functools

import torch

from kvforge.kernels.cpu.extension import cpu_kernels
from kvforge.kernels.cpu.half_gemv import native_bf16_gemm

# NOTE: rows of x from which a call unpacks. Measured on the Xeon VM of benchmarks/RESULTS.md (2 threads, AVX-512 BF16
# and AMX), one Llama-3.2-1B layer's weights (2048x2048, 8192x2048, 2048x8192) as Q4_K and Q6_K, the int8 panel
# kernel against unpack + GEMM interleaved in one process: see UNPACK_MIN_ROWS's figures in the module's tests'
# benchmark (python -m kvforge.benchmarks.panel_bf16).
UNPACK_MIN_ROWS = 32
# Weights of more elements keep the int8 kernel at every row count: the buffer is as large as the largest weight that
# unpacks (a vocabulary's LM head, 128256 x 2048 in bfloat16, would be 500 MiB; Llama-3-8B's MLP, 14336 x 4096,
# 112 MiB).
UNPACK_MAX_WEIGHTS = 1 << 26


@functools.cache
def unpack_available() -> bool:
    """The C++ kernels are built with AVX-512 and the CPU multiplies bfloat16 in hardware."""
    return cpu_kernels() is not None and torch.ops.kvforge_cpu.panel_unpack_available() and native_bf16_gemm()


def unpacks(out_features: int, in_features: int) -> bool:
    """A weight of this shape takes the bfloat16 GEMM for many rows, on this CPU."""
    return out_features * in_features <= UNPACK_MAX_WEIGHTS and unpack_available()


def takes_rows(num_rows: int) -> bool:
    """A call of num_rows rows of x unpacks (a weight for which `unpacks`), outside compiled graphs (whose decode
    steps keep the int8 kernel: the buffer is state a graph does not see)."""
    return num_rows >= UNPACK_MIN_ROWS and not torch.compiler.is_compiling()


class UnpackBuffer:
    """The bfloat16 memory every unpacked weight of one model is written into in turn (its layers run one at a time),
    grown to the largest; one per model (the loader's PanelArena holds it), never shared between models."""

    def __init__(self) -> None:
        self._memory = torch.empty(0, dtype=torch.bfloat16)

    def take(self, rows: int, columns: int) -> torch.Tensor:
        """A bfloat16 [rows, columns] view of the memory, whose values are whatever was written last."""
        if self._memory.numel() < rows * columns:
            self._memory = torch.empty(rows * columns, dtype=torch.bfloat16)
        return self._memory[: rows * columns].view(rows, columns)


def unpack_bf16(weight: torch.Tensor, factor: float, bits: int, out_features: int, out: torch.Tensor | None = None
                ) -> torch.Tensor:  # fmt: skip
    """W^T [K, out_features] bfloat16 of a panel-layout weight, into out where given."""
    in_features = weight.shape[2] * _group_columns(weight, bits)
    if out is None:
        out = torch.empty(in_features, out_features, dtype=torch.bfloat16)
    torch.ops.kvforge_cpu.panel_unpack_bf16(weight, bits, out_features, factor, out)
    return out


def panel_linear_bf16(x: torch.Tensor, weight: torch.Tensor, factor: float, bits: int, out_features: int,
                      buffer: UnpackBuffer | None) -> torch.Tensor:  # fmt: skip
    """x [M, K] float -> x W^T [M, out_features] in x's dtype, by the bfloat16 GEMM on the weight unpacked into
    buffer (None: memory of its own)."""
    in_features = x.shape[1]
    out = None if buffer is None else buffer.take(in_features, out_features)
    transposed = unpack_bf16(weight, factor, bits, out_features, out)
    return torch.mm(x.to(torch.bfloat16), transposed).to(x.dtype)


def _group_columns(weight: torch.Tensor, bits: int) -> int:
    """Columns of W in one group of the layout [T, S, G, group bytes]: its code bytes over 64 bytes a vector, each
    vector 4 columns of 8-bit codes (8 of 4-bit ones; 6-bit codes: 3 vectors hold 16 columns)."""
    group_bytes = weight.shape[3]
    code_bytes = group_bytes - (32 if group_bytes % 64 == 32 else 64)
    return code_bytes * 8 // (bits * 16)
