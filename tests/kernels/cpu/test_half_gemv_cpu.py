"""The 16-bit weight GEMV (csrc/half_gemv.cpp), in both its vector widths, and half_linear's widened GEMM above it,
against F.linear on the weight widened to float32: alone and inside a Linear; and the AVX2 build's own (256-bit) path,
loaded in a process of its own, where that build came with the checkout. A GGUF file's F16 and BF16
models run through them in tests/quantization/test_gguf_16bit.py."""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvforge.kernels.cpu import builds
from kvforge.kernels.cpu.dense_gemv import dense_linear, use_dense_gemv
from kvforge.kernels.cpu.half_gemv import (
    BF16_GEMV_MAX_TOKENS,
    HALF_GEMV_MAX_TOKENS,
    WIDEN_ROWS,
    half_linear,
    native_bf16_gemm,
)
from kvforge.kernels.cpu.quant_gemv import native_kernels_available
from kvforge.layers.linear import Linear

needs_avx2 = pytest.mark.skipif(not native_kernels_available(), reason="the AVX2 build of the CPU kernels")
DTYPES = [torch.float16, torch.bfloat16]


def _widths() -> list[int]:
    """The vector widths this build has: 256 (AVX2 + F16C, the AVX2 build's only path) and 512 (AVX-512 builds)."""
    if not native_kernels_available():
        return []
    return [bits for bits in (256, 512) if bits <= torch.ops.kvforge_cpu.half_gemv_widest()]


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    # NOTE: the weights are widened exactly; only the order of the float32 sums differs from F.linear's
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5 * ref.abs().max().item())


def _close_to_bf16_product(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                           ) -> None:  # fmt: skip
    """out is x rounded to bfloat16 times the weight, the product rounded to bfloat16 (within one of its units: the
    float32 sums' order may move a rounding), plus the bias in float32."""
    product = F.linear(x.bfloat16().float(), weight.float()).bfloat16().float()
    ref = product if bias is None else product + bias
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=2**-7, atol=1e-5 * ref.abs().max().item())
    assert (out - F.linear(x, weight.float(), bias)).abs().max() > 0  # rounded: not the float32 product


def _operands(rows: int, out_features: int, in_features: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    return torch.randn(rows, in_features, generator=gen), weight


@needs_avx2
@pytest.mark.parametrize("vector_bits", [256, 512])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, HALF_GEMV_MAX_TOKENS])
@pytest.mark.parametrize(("out_features", "in_features"), [(577, 1536), (64, 40), (7, 13), (1, 8)])
def test_gemv_equals_f_linear_on_the_widened_weight(vector_bits, dtype, rows, out_features, in_features):
    if vector_bits not in _widths():
        pytest.skip(f"this build has no {vector_bits}-bit path")
    x, weight = _operands(rows, out_features, in_features, dtype)
    out = torch.ops.kvforge_cpu.half_gemv(x, weight, vector_bits)
    _close(out, F.linear(x, weight.float()))
    assert weight.dtype == dtype  # read as it is


@needs_avx2
def test_gemv_refuses_bad_operands():
    x, weight = _operands(2, 8, 16, torch.float16)
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        torch.ops.kvforge_cpu.half_gemv(x, weight.float(), 0)
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        torch.ops.kvforge_cpu.half_gemv(x, weight.t(), 0)  # not contiguous
    with pytest.raises(RuntimeError, match=r"float32 \[M, 16\]"):
        torch.ops.kvforge_cpu.half_gemv(x[:, :8], weight, 0)
    with pytest.raises(RuntimeError, match="vector_bits must be 0, 256 or 512, not 128"):
        torch.ops.kvforge_cpu.half_gemv(x, weight, 128)


def _rounds_x(dtype: torch.dtype, rows: int, gemv: bool) -> bool:
    """half_linear multiplies these rows with the CPU's bfloat16 GEMM (x rounded to bfloat16)."""
    return dtype == torch.bfloat16 and native_bf16_gemm() and not (gemv and rows <= BF16_GEMV_MAX_TOKENS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [BF16_GEMV_MAX_TOKENS + 1, HALF_GEMV_MAX_TOKENS + 1, 64])
@pytest.mark.parametrize("out_features", [WIDEN_ROWS + 3, 7])
def test_many_rows_equal_f_linear_on_the_widened_weight(dtype, rows, out_features):
    """Above the GEMV's rows, the widened GEMM equals F.linear on the widened weight; a CPU that multiplies bfloat16
    (AVX-512 BF16) takes its bfloat16 GEMM for a bfloat16 weight: x and the product rounded to bfloat16."""
    x, weight = _operands(rows, out_features, 96, dtype)
    bias = torch.randn(out_features)
    for gemv in (False, True):
        out = half_linear(x, weight, bias, gemv)
        if _rounds_x(dtype, rows, gemv):
            _close_to_bf16_product(out, x, weight, bias)
        else:
            _close(out, F.linear(x, weight.float(), bias))


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_with_a_16_bit_weight_runs_in_float32(dtype):
    """A Linear whose weight is kept in 16 bits (as the GGUF loader leaves F16/BF16 layers): float32 in and out at
    every row count, and no float32 copy of the weight made at load. (Compiled: the F16 engine of
    tests/quantization/test_gguf_16bit.py.)"""
    layer = Linear(96, [40, 24], bias=True)
    weight = torch.randn(64, 96).to(dtype)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer.bias.data.normal_()
    layer.process_weights_after_loading()  # the end of a load: the float kernel, then the CPU paths
    use_dense_gemv(layer)
    assert layer.weight.dtype == dtype and layer.kernel.onednn_weight is None
    assert layer.kernel.dense_gemv == native_kernels_available()
    for rows in (1, 4, HALF_GEMV_MAX_TOKENS + 3):
        x = torch.randn(rows, 96)
        if _rounds_x(dtype, rows, layer.kernel.dense_gemv):
            _close_to_bf16_product(layer(x), x, weight, layer.bias)
        else:
            _close(layer(x), F.linear(x, weight.float(), layer.bias))
    gemv = layer.kernel.dense_gemv
    assert dense_linear(x.to(dtype), weight, None, gemv).dtype == dtype  # a model run in its own dtype


_IN_THE_AVX2_BUILD = """
import torch
import torch.nn.functional as F
from kvforge.kernels.cpu.extension import kernels_build
build = kernels_build()
assert build.origin == "built with the package" and torch.ops.kvforge_cpu.quant_gemv_isa() == "avx2", build.describe()
assert torch.ops.kvforge_cpu.half_gemv_widest() == 256
for dtype in (torch.float16, torch.bfloat16):
    for rows in (1, 5):
        x, weight = torch.randn(rows, 1544), torch.randn(77, 1544).to(dtype)
        ref = F.linear(x, weight.float())
        out = torch.ops.kvforge_cpu.half_gemv(x, weight, 0)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5 * ref.abs().max().item())
"""


def _avx2_build_present() -> bool:
    variant = next(v for v in builds.VARIANTS if v.isa == "avx2")
    name = f"kvforge.kernels.cpu.{variant.module_name(builds.sources_digest())}"
    return variant.runs_on(builds.cpu_flags()) and importlib.util.find_spec(name) is not None


@pytest.mark.skipif(platform.machine().lower() not in builds.X86_MACHINES or not _avx2_build_present(),
                    reason="no AVX2 build of these sources came with the checkout (setup.py, KVFORGE_CPU_VARIANTS)")
def test_the_avx2_build_equals_f_linear_on_the_widened_weight():
    """The AVX2 variant (-march=x86-64-v3, what a CPU without AVX-512 loads) chosen with KVFORGE_CPU_VARIANT."""
    env = {**os.environ, "KVFORGE_CPU_VARIANT": "avx2"}
    done = subprocess.run([sys.executable, "-c", _IN_THE_AVX2_BUILD], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
