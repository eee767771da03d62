"""MXFP4: the dequantizer against transformers' own (its GPT-OSS loader), the quantizer against the format's
definition, and GPT-OSS's MoE on MXFP4 weights (the CPU path and the Triton kernel in the interpreter) against the
reference, with odd sizes, experts without tokens and pairs of other ranks."""

from __future__ import annotations

import pytest
import torch

from kvforge.kernels.mxfp4 import E2M1_VALUES, dequantize_mxfp4, quantize_mxfp4
from kvforge.kernels.mxfp4_moe import _gathered, mxfp4_experts, mxfp4_moe_cpu, mxfp4_moe_ref, mxfp4_moe_triton

ALPHA, LIMIT = 1.702, 7.0


def test_dequantize_matches_transformers() -> None:
    """Random codes and scales, as a checkpoint stores them ([experts, rows, K / 32, 16]): transformers' loader
    gives the transposed [experts, K, rows] float weight, ours [experts, rows, K]."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks = torch.randint(0, 256, (3, 5, 3, 16), dtype=torch.uint8)
    scales = torch.randint(118, 134, (3, 5, 3), dtype=torch.uint8)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, 96, 5]
    assert torch.equal(dequantize_mxfp4(blocks, scales), theirs.transpose(1, 2))


def test_quantize_by_the_definition() -> None:
    """A block's scale is 2 ** (floor(log2(amax)) - 2); every value is the nearest e2m1 value times it, clamped."""
    weight = torch.randn(7, 64) * torch.logspace(-3, 2, 7)[:, None]
    weight[2, :32] = 0.0  # an all-zero block
    blocks, scales = quantize_mxfp4(weight)
    assert blocks.shape == (7, 2, 16) and scales.shape == (7, 2)
    groups = weight.view(7, 2, 32)
    amax = groups.abs().amax(-1)
    expected_exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127))
    assert torch.equal(scales.float() - 127, expected_exp)
    grid = torch.tensor(E2M1_VALUES[:8])
    scaled = (groups / torch.exp2(expected_exp)[..., None]).clamp(-6, 6)
    chosen = dequantize_mxfp4(blocks, scales).view(7, 2, 32) / torch.exp2(expected_exp)[..., None]
    best = (scaled.abs()[..., None] - grid).abs().min(-1).values  # the distance to the nearest e2m1 value
    torch.testing.assert_close((chosen.abs() - scaled.abs()).abs(), best, rtol=0, atol=1e-6)
    assert (chosen * scaled >= 0).all()
    # the round trip of representable values is exact
    exact = torch.tensor(E2M1_VALUES * 4).view(2, 32) * torch.tensor([[0.25], [8.0]])
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(exact)), exact)


def _problem(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int, routing: str):
    w13_blocks, w13_scales = quantize_mxfp4(torch.randn(num_experts, 2 * inter, hidden) / hidden**0.5)
    w2_blocks, w2_scales = quantize_mxfp4(torch.randn(num_experts, hidden, inter) / inter**0.5)
    w13_bias, w2_bias = torch.randn(num_experts, 2 * inter), torch.randn(num_experts, hidden)
    ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)])
    if routing == "skewed":  # expert 1 takes every token's first slot, the last expert no pair
        ids = torch.stack([torch.tensor([1, *(torch.randperm(num_experts - 2)[: top_k - 1] + 2).tolist()])
                           for _ in range(num_tokens)]) % (num_experts - 1)  # fmt: skip
    elif routing == "other_ranks":
        ids = torch.where(ids < 3, ids, -1)
    weights = torch.rand(num_tokens, top_k).softmax(-1)
    hidden_states = torch.randn(num_tokens, hidden) * 3  # large enough for the clamps to bite
    return hidden_states, w13_blocks, w13_scales, w13_bias, w2_blocks, w2_scales, w2_bias, weights, ids


@pytest.mark.parametrize(("num_tokens", "hidden", "inter", "num_experts", "top_k", "routing"), [
    (1, 32, 32, 4, 2, "even"),
    (7, 96, 64, 5, 3, "skewed"),
    (19, 64, 96, 7, 2, "other_ranks"),
])  # fmt: skip
def test_mxfp4_moe_cpu_and_triton_match_reference(num_tokens, hidden, inter, num_experts, top_k, routing) -> None:
    problem = _problem(num_tokens, hidden, inter, num_experts, top_k, routing)
    expected = mxfp4_moe_ref(*problem, ALPHA, LIMIT)
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(mxfp4_moe_cpu(*problem, ALPHA, LIMIT), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(mxfp4_moe_triton(*problem, ALPHA, LIMIT), expected, rtol=0, atol=1e-4)
    # the CPU path's branch for a compiled step: each pair's expert weights gathered and dequantized
    hidden_states, w13_blocks, w13_scales, w13_bias, w2_blocks, w2_scales, w2_bias, weights, ids = problem
    weights_of = mxfp4_experts(w13_blocks, w13_scales, w2_blocks, w2_scales)
    gathered = _gathered(hidden_states, weights_of, w13_bias, w2_bias, weights, ids, ALPHA, LIMIT)
    torch.testing.assert_close(gathered, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mxfp4_moe_triton_half_activations(dtype) -> None:
    """Half-precision activations: the codes decoded into their dtype, fp32 accumulation; within the rounding of
    the activation between the GEMMs and of the output (measured: |out| up to 22, off by at most 0.0098 in fp16 and
    0.077 in bf16, an output ulp)."""
    hidden_states, *weights = _problem(11, 64, 64, 4, 2, "even")
    hidden_states = hidden_states.to(dtype)
    expected = mxfp4_moe_ref(hidden_states.float(), *weights, ALPHA, LIMIT)
    out = mxfp4_moe_triton(hidden_states, *weights, ALPHA, LIMIT)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, rtol=0, atol=2e-2 if dtype == torch.float16 else 1.5e-1)
