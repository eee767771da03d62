"""The float32 decode GEMV (csrc/dense_gemv.cpp) against F.linear: alone, inside a Linear and a float LM head, and
compiled. Loaded float32 models decode through it in the tests against transformers (tests/models,
tests/test_default_model.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvforge.kernels.cpu.dense_gemv import DENSE_GEMV_MAX_TOKENS, dense_linear, use_dense_gemv
from kvforge.kernels.cpu.quant_gemv import native_kernels_available
from kvforge.layers.embedding import VocabParallelEmbedding
from kvforge.layers.linear import Linear

needs_avx2 = pytest.mark.skipif(not native_kernels_available(), reason="the AVX2 build of the CPU kernels")


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    # NOTE: fp32 sums in another order: measured differences stay under 1e-5 of the largest |ref| for K <= 1536
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5 * ref.abs().max().item())


@needs_avx2
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16, DENSE_GEMV_MAX_TOKENS])
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (577, 1536), (7, 13), (1, 8)])
def test_gemv_equals_f_linear(rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    _close(torch.ops.kvforge_cpu.dense_gemv(x, weight), F.linear(x, weight))


@needs_avx2
def test_non_contiguous_rows_of_x_and_bad_weights():
    x = torch.randn(4, 64)[:, :32]
    weight = torch.randn(9, 32)
    _close(torch.ops.kvforge_cpu.dense_gemv(x, weight), F.linear(x, weight))
    with pytest.raises(RuntimeError, match="weight must be a contiguous float32"):
        torch.ops.kvforge_cpu.dense_gemv(x, weight.t().contiguous().t())
    with pytest.raises(RuntimeError, match=r"x must be a float32 \[M, 32\]"):
        torch.ops.kvforge_cpu.dense_gemv(x.double(), weight)


@needs_avx2
def test_bias_leading_dims_and_rows_past_the_gemv_take_f_linear_results():
    weight, bias = torch.randn(50, 96), torch.randn(50)
    for shape in ((1, 96), (DENSE_GEMV_MAX_TOKENS, 96), (DENSE_GEMV_MAX_TOKENS + 1, 96), (200, 96), (2, 3, 96)):
        x = torch.randn(shape)
        _close(dense_linear(x, weight, bias, gemv=True), F.linear(x, weight, bias))


@needs_avx2
def test_loaded_layers_and_float_head_use_the_gemv():
    model = torch.nn.ModuleList([Linear(64, [32, 16], bias=True), VocabParallelEmbedding(100, 64)])
    for param in model.parameters():
        param.data.normal_()
    use_dense_gemv(model)
    linear, head = model
    assert linear.dense_gemv and head.dense_gemv
    x = torch.randn(3, 64)
    _close(linear(x), F.linear(x, linear.weight, linear.bias))
    _close(head.compute_logits(x), F.linear(x, head.weight))


def test_other_dtypes_keep_f_linear():
    model = torch.nn.ModuleList([Linear(64, [32]).to(torch.bfloat16)])
    use_dense_gemv(model)
    assert not model[0].dense_gemv


@needs_avx2
def test_compiled_gemv_matches_eager():
    weight = torch.randn(40, 64)
    x = torch.randn(2, 64)
    compiled = torch.compile(lambda t: dense_linear(t, weight, None, gemv=True), fullgraph=True)
    _close(compiled(x), F.linear(x, weight))
