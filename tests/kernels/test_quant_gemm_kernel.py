"""Quantized GEMM kernels (W4A16/W8A16 dequantize-and-multiply, W8A8 int8) against their references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from kvforge.kernels.int8_gemm import int8_gemm_ref, int8_gemm_triton, quantize_per_token_ref
from kvforge.kernels.ops import op_table
from kvforge.kernels.quant_gemm import pack_codes, quant_gemm_ref, quant_gemm_triton, unpack_codes
from kvforge.quantization.gguf_blocks import BLOCK_LAYOUTS, decode_blocks
from kvforge.quantization.quantized_weight import RowShards
from kvforge.quantization.shard_runs import select_merged_kernel
from tests.quantization.test_gguf_quants import MIXED_IN, MIXED_ROWS, MIXED_SHARDS, mixed_shards

# Byte offsets of the float16 d / dmin fields of each GGUF block type (the rest of a random block is any bytes).
GGUF_SCALE_OFFSETS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.IQ4_NL: (0,),
                      Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
                      Q.IQ4_XS: (0,)}  # fmt: skip


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    "num_tokens,out_features,in_features,group_size",
    [(1, 40, 64, 32), (3, 96, 128, 128), (17, 70, 96, 32), (33, 16, 256, 64), (2, 40, 96, 48), (5, 33, 48, 24)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quant_gemm_matches_reference(
    device: torch.device,
    bits: int,
    num_tokens: int,
    out_features: int,
    in_features: int,
    group_size: int,
    dtype: torch.dtype,
) -> None:
    codes = torch.randint(0, 2**bits, (out_features, in_features), device=device)
    qweight = pack_codes(codes, bits)
    assert torch.equal(unpack_codes(qweight, bits), codes.to(torch.uint8))
    num_groups = in_features // group_size
    scales = (torch.rand(out_features, num_groups, device=device) * 0.1).to(dtype)
    zeros = torch.randint(0, 2**bits, (out_features, num_groups), device=device).to(dtype)
    x = torch.randn(num_tokens, in_features, device=device, dtype=dtype)
    expected = quant_gemm_ref(x, qweight, scales, zeros, bits)
    got = quant_gemm_triton(x, qweight, scales, zeros, bits)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        got.float(), expected.float(), rtol=tol, atol=tol * expected.abs().max().item()
    )


def test_quant_gemm_rejects_a_bad_qweight(device: torch.device) -> None:
    x = torch.randn(2, 64, device=device)
    scales = torch.ones(8, 2, device=device)
    with pytest.raises(ValueError, match="qweight"):
        quant_gemm_triton(x, torch.zeros(8, 64, dtype=torch.uint8, device=device), scales, scales, 4)


@pytest.mark.parametrize("num_tokens,out_features,in_features", [(1, 24, 64), (5, 33, 100), (40, 64, 160)])
def test_int8_gemm_matches_reference_exactly(
    device: torch.device, num_tokens: int, out_features: int, in_features: int
) -> None:
    x = torch.randn(num_tokens, in_features, device=device)
    a, a_scales = quantize_per_token_ref(x)
    b = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, device=device)
    b_scales = torch.rand(out_features, device=device)
    expected = int8_gemm_ref(a.cpu(), b.cpu(), a_scales.cpu(), b_scales.cpu(), torch.float32)
    got = int8_gemm_triton(a, b, a_scales, b_scales, torch.float32)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(
        a.float() * a_scales[:, None], x, rtol=0, atol=x.abs().max().item() / 254 + 1e-6
    )


@pytest.mark.parametrize("qtype", sorted(BLOCK_LAYOUTS, key=lambda q: q.name), ids=lambda q: q.name)
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_gguf_blocks_through_the_generic_kernel_match_gguf(device: torch.device, qtype, num_tokens: int) -> None:
    """A GPU reads a GGUF file's blocks as the generic layout (codes, a scale and zero point per 16- or 32-column
    group; gguf_blocks.py) and dequantizes them in the GEMM's K loop: equal to the `gguf` package's dequantization
    followed by a float matmul."""
    out_features, in_features = 33, 512
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    blocks = rng.integers(0, 256, (out_features, in_features // block_size, block_bytes), dtype=np.uint8)
    for offset in GGUF_SCALE_OFFSETS[qtype]:  # sane float16 d / dmin fields
        halves = rng.uniform(0.001, 0.01, blocks.shape[:2]).astype(np.float16)
        blocks[:, :, offset : offset + 2] = halves.view(np.uint8).reshape(*blocks.shape[:2], 2)
    data = blocks.reshape(out_features, -1)
    weight = decode_blocks(data, qtype, (out_features, in_features)).widened()  # 6-bit codes as 8-bit ones
    reference = torch.from_numpy(dequantize(data, qtype).reshape(out_features, in_features))
    x = torch.randn(num_tokens, in_features)
    got = quant_gemm_triton(x.to(device), pack_codes(weight.codes, weight.bits).to(device), weight.scales.to(device),
                            weight.zeros.to(device), weight.bits)
    expected = x @ reference.t()
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def test_merged_layer_of_mixed_gguf_types_through_the_triton_kernels(device: torch.device) -> None:
    """A Q4_K_M file's q, k (Q4_K) and v (Q6_K) in one merged layer on the Triton op table: a generic kernel per width
    (q and k in 4-bit codes, v in 8-bit ones, not all three in 8), equal to the `gguf` package's dequantization
    followed by a float matmul."""
    blocks = mixed_shards(0)
    weights = [decode_blocks(data, q, (MIXED_ROWS, MIXED_IN)) for data, q in zip(blocks, MIXED_SHARDS)]
    kernel = select_merged_kernel(RowShards(weights, 6, 16), device, torch.float32, op_table("triton"))
    assert [run.bits for run in kernel.runs] == [4, 8]
    reference = torch.from_numpy(np.concatenate([dequantize(d, q) for d, q in zip(blocks, MIXED_SHARDS)]))
    x = torch.randn(3, MIXED_IN)
    expected = x @ reference.t()
    got = kernel.apply(x.to(device)).cpu()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
