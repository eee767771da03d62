"""The float32 decode GEMV (csrc/dense_gemv.cpp) and the oneDNN matmul above it against F.linear: alone, inside a
Linear and a float LM head, and compiled. Loaded float32 models decode through them in the tests against transformers
(tests/models, tests/test_default_model.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvforge.kernels.cpu.dense_gemv import (
    DENSE_GEMV_MAX_TOKENS,
    ONEDNN,
    dense_linear,
    drop_packed_weights,
    use_dense_gemv,
)
from kvforge.kernels.cpu.quant_gemv import native_kernels_available
from kvforge.layers.embedding import VocabParallelEmbedding
from kvforge.layers.linear import Linear
from kvforge.quantization import process_weights_after_loading

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


needs_onednn = pytest.mark.skipif(not ONEDNN, reason="torch built without oneDNN")


@needs_avx2
@needs_onednn
@pytest.mark.parametrize("rows", [DENSE_GEMV_MAX_TOKENS + 1, 16, 64, 200])
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (577, 1536), (7, 13), (1, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_rows_past_the_gemv_take_onednn_equal_to_f_linear(rows, out_features, in_features, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    _close(torch.ops.kvforge_cpu.onednn_linear(x, weight, b), F.linear(x, weight, b))
    _close(torch.ops.kvforge_cpu.onednn_linear(x[::2], weight, b), F.linear(x[::2], weight, b))  # strided rows


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


def _loaded(model: torch.nn.Module) -> None:
    """The end of a load: each Linear's kernel prepared from its weight, then the CPU paths turned on."""
    process_weights_after_loading(model)
    use_dense_gemv(model)


@needs_avx2
def test_loaded_layers_and_float_head_use_the_gemv():
    model = torch.nn.ModuleList([Linear(64, [32, 16], bias=True), VocabParallelEmbedding(100, 64)])
    for param in model.parameters():
        param.data.normal_()
    _loaded(model)
    linear, head = model
    assert linear.kernel.dense_gemv and head.dense_gemv
    x = torch.randn(3, 64)
    _close(linear(x), F.linear(x, linear.weight, linear.bias))
    _close(head.compute_logits(x), F.linear(x, head.weight))


def test_a_model_run_in_16_bits_keeps_f_linear():
    """Every tensor of the layer in bfloat16 (a model run in it, not a weight kept in 16 bits beside float32
    activations): F.linear in bfloat16, no packed copy."""
    model = torch.nn.ModuleList([Linear(64, [32]).to(torch.bfloat16)])
    model[0].weight.data.normal_()
    _loaded(model)
    assert model[0].kernel.onednn_weight is None
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(model[0](x), F.linear(x, model[0].weight))


@needs_avx2
def test_compiled_gemv_matches_eager():
    weight, bias = torch.randn(40, 64), torch.randn(40)
    compiled = torch.compile(lambda t: dense_linear(t * 2, weight, bias, gemv=True) + 1, fullgraph=True)
    for rows in (2, 24):  # the GEMV, oneDNN
        x = torch.randn(rows, 64)
        _close(compiled(x), F.linear(x * 2, weight, bias) + 1)


@needs_avx2
@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN")
def test_packed_weight_matches_f_linear_eager_and_compiled():
    """Above the GEMV's rows, a layer multiplies by its weight packed in oneDNN's layout, in eager and compiled
    code alike (the packed tensor passes through the graph into the opaque op)."""
    model = torch.nn.ModuleList([Linear(64, [40], bias=True)])
    for param in model.parameters():
        param.data.normal_()
    _loaded(model)
    linear = model[0]
    assert linear.kernel.onednn_weight is not None and linear.kernel.onednn_weight.is_mkldnn
    compiled = torch.compile(lambda t: linear(t * 2) + 1, fullgraph=True)
    for rows in (DENSE_GEMV_MAX_TOKENS + 1, 64, 300):
        x = torch.randn(rows, 64)
        expected = F.linear(x, linear.weight, linear.bias)
        _close(linear(x), expected)
        _close(compiled(x / 2) - 1, expected)


@needs_avx2
@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN")
def test_only_a_table_used_as_the_head_is_packed_and_writers_drop_the_copies():
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens, self.lm_head = VocabParallelEmbedding(100, 64), VocabParallelEmbedding(100, 64)

    model = Model()
    for param in model.parameters():
        param.data.normal_()
    use_dense_gemv(model)
    assert model.embed_tokens.onednn_weight is None and model.lm_head.onednn_weight is not None
    x = torch.randn(DENSE_GEMV_MAX_TOKENS + 3, 64)
    _close(model.lm_head.compute_logits(x), F.linear(x, model.lm_head.weight))
    drop_packed_weights(model)
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    assert model.lm_head.onednn_weight is None
    _close(model.lm_head.compute_logits(x), F.linear(x, model.lm_head.weight))
