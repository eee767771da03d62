"""GGUF Q8_0 / Q4_0 / Q4_1 blocks decoded into QuantizedWeights, against the `gguf` package's own
dequantization, and a merged Linear running on them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from kvforge.kernels.cpu.quant_panels import SUPER_BLOCK, int8_rows
from kvforge.kernels.ops import TORCH_OPS
from kvforge.layers.linear import Linear
from kvforge.quantization.gguf_blocks import decode_blocks
from kvforge.quantization.gguf_quants import GGUFMethod
from kvforge.quantization.quantized_weight import QuantizedWeight, RowShards
from kvforge.quantization.weight_only_kernels import select_kernel
from tests.kernels.cpu.test_quant_gemv_cpu import native_layer_input
from tests.loader.test_gguf import random_blocks

KEPT = [Q.Q8_0, Q.Q4_0, Q.Q4_1]


def weights_with_odd_blocks(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """Random weights plus blocks that stress the zero points: constant, all zero, all positive, tiny."""
    weight = rng.normal(size=shape).astype(np.float32)
    weight[0, :32] = 0.7  # constant: Q4_1 stores d = 0, m = 0.7
    weight[1, 32:64] = 0.0
    weight[2, :32] = rng.uniform(1.0, 1.1, 32)  # Q4_1 zero point far below the codes (-m / d ~ -150)
    weight[3, 64:96] = rng.uniform(-1e-4, 1e-4, 32)
    return weight


@pytest.mark.parametrize("qtype", KEPT, ids=lambda q: q.name)
def test_dequantize_equals_gguf(qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    data = quantize(weights_with_odd_blocks(rng, (48, 160)), qtype)
    reference = dequantize(data, qtype)
    weight = decode_blocks(data, qtype, (48, 160))
    assert weight.codes.dtype == torch.uint8 and weight.codes.shape == (48, 160)
    assert weight.group_size == 32 and weight.bits == (8 if qtype == Q.Q8_0 else 4)
    assert int(weight.codes.max()) < 2**weight.bits
    ours = weight.dequantize().numpy()
    if qtype == Q.Q4_1:
        # (q + m / d) * d against d * q + m: float32 rounding of the block's magnitude, no more
        blocks = np.abs(reference).reshape(48, -1, 32).max(axis=-1, keepdims=True)
        bound = np.broadcast_to(4 * 2.0**-24 * blocks, (48, 5, 32)).reshape(48, 160)
        assert (np.abs(ours - reference) <= bound).all()
        assert not torch.equal(weight.zeros, weight.zeros.round())  # float zero points
    else:
        np.testing.assert_array_equal(ours, reference)


def test_q4_1_constant_block_with_zero_scale() -> None:
    """Raw blocks with d = 0 and arbitrary nibbles: every weight is m."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (4, 2, GGML_QUANT_SIZES[Q.Q4_1][1]), dtype=np.uint8)
    blocks[..., :2] = np.zeros((4, 2, 1), dtype=np.float16).view(np.uint8)
    blocks[..., 2:4] = rng.uniform(-1, 1, (4, 2, 1)).astype(np.float16).view(np.uint8)
    data = blocks.reshape(4, -1)
    np.testing.assert_array_equal(decode_blocks(data, Q.Q4_1, (4, 64)).dequantize().numpy(), dequantize(data, Q.Q4_1))


def test_decode_rejects_other_types_and_sizes() -> None:
    data = quantize(np.ones((2, 64), dtype=np.float32), Q.Q8_0)
    with pytest.raises(ValueError, match="IQ2_XXS has no block decoder"):
        decode_blocks(data, Q.IQ2_XXS, (2, 64))
    with pytest.raises(ValueError, match="do not hold a 2x96 matrix"):
        decode_blocks(data, Q.Q8_0, (2, 96))


@pytest.mark.parametrize("num_tokens", [1, 24])
@pytest.mark.parametrize("shard_types", [(Q.Q4_0, Q.Q4_1), (Q.Q4_1, Q.Q8_0)], ids=["4bit", "8bit"])
def test_merged_layer_computes_with_the_gguf_weights(num_tokens: int, shard_types: tuple[Q, Q]) -> None:
    rng = np.random.default_rng(num_tokens)
    shards = [quantize(rng.normal(size=(64, 128)).astype(np.float32), q) for q in shard_types]
    weights = [decode_blocks(data, q, (64, 128)) for data, q in zip(shards, shard_types)]
    bits = max(w.bits for w in weights)
    layer = Linear(128, [64, 64], bias=True)
    layer.set_format(GGUFMethod(bits))
    bias = torch.randn(128)
    for shard, weight in enumerate(weights):
        for name in ("codes", "scales", "zeros"):
            layer.load_shard(name, shard, getattr(weight, name))
        layer.load_shard("bias", shard, bias[64 * shard : 64 * (shard + 1)])
    layer.process_weights_after_loading()
    assert layer.kernel.bits == bits and not hasattr(layer, "codes") and not hasattr(layer, "weight")
    reference = torch.from_numpy(np.concatenate([dequantize(d, q) for d, q in zip(shards, shard_types)]))
    x = torch.randn(num_tokens, 128)
    # NOTE: the CPU's int4pack rounds activations and scales to bfloat16; the other kernels are exact
    # up to float32 rounding, of x rounded to int8 in the native GEMV and the panel kernel.
    expected = native_layer_input(x, kernel=layer.kernel.name) @ reference.t() + bias
    tolerance = 2e-2 if layer.kernel.name == "int4pack" else 1e-5
    scale = (x.abs() @ reference.abs().t()).max()
    assert (layer(x) - expected).abs().max() <= tolerance * scale


def test_shards_in_groups_of_32_and_16_stack_to_the_same_weight() -> None:
    """A merged layer's RowShards (4-bit codes in groups of 32 as Q4_K's, 6-bit ones in groups of 16 as Q6_K's)
    stacked for the kernels that take one tensor: the same weights, each scale and zero point of 32 columns repeated
    for its two groups of 16, and the same layer output as the kernel that takes the shards as they are."""
    generator = torch.Generator().manual_seed(0)

    def shard(rows: int, bits: int, group_size: int) -> QuantizedWeight:
        groups = (rows, 256 // group_size)
        return QuantizedWeight(torch.randint(0, 2**bits, (rows, 256), generator=generator, dtype=torch.uint8),
                               torch.rand(groups, generator=generator) - 0.5,
                               torch.rand(groups, generator=generator) * 2**bits, bits)

    shards = [shard(48, 4, 32), shard(16, 6, 16)]
    stacked = RowShards(shards, bits=6, group_size=16).stacked()
    assert stacked.codes.shape == (64, 256) and stacked.scales.shape == stacked.zeros.shape == (64, 16)
    reference = torch.cat([weight.dequantize() for weight in shards])
    torch.testing.assert_close(stacked.dequantize(), reference, rtol=0, atol=1e-6)
    x = torch.randn(3, 256, generator=generator)
    as_shards = select_kernel(RowShards(shards, bits=6, group_size=16), torch.device("cpu"), torch.float32, TORCH_OPS)
    as_one = select_kernel(stacked, torch.device("cpu"), torch.float32, TORCH_OPS)
    assert as_shards.name == as_one.name and torch.equal(as_shards.apply(x), as_one.apply(x))


# A Q4_K_M file's attention: q and k Q4_K (4-bit codes in groups of 32), v Q6_K (6-bit codes in groups of 16); each
# 256 rows, 16 panels of the CPU panel layout, which any thread count up to 16 splits without padding rows.
MIXED_SHARDS = [Q.Q4_K, Q.Q4_K, Q.Q6_K]
MIXED_ROWS, MIXED_IN = 256, 256


def mixed_shards(seed: int) -> list[np.ndarray]:
    """Random blocks of MIXED_SHARDS (the gguf package quantizes no K-quant), as a file holds them."""
    rng = np.random.default_rng(seed)
    return [random_blocks(rng, qtype, (MIXED_ROWS, MIXED_IN)) for qtype in MIXED_SHARDS]


def gguf_layer(blocks: list[np.ndarray], qtypes: list[Q], bias: torch.Tensor | None = None) -> Linear:
    """A Linear of the shards (one merged layer if several), loaded as a GGUF file's layer is (keep_gguf_quantized's
    GGUFMethod: each shard in its own width, the layer's groups the narrowest)."""
    weights = [decode_blocks(data, q, (MIXED_ROWS, MIXED_IN)) for data, q in zip(blocks, qtypes)]
    bits = tuple(w.bits for w in weights)
    layer = Linear(MIXED_IN, [MIXED_ROWS] * len(weights), bias=bias is not None)
    layer.set_format(GGUFMethod(max(bits), min(w.group_size for w in weights), bits))
    for shard, weight in enumerate(weights):
        for name in ("codes", "scales", "zeros"):
            layer.load_shard(name, shard, getattr(weight, name))
        if bias is not None:
            layer.load_shard("bias", shard, bias[MIXED_ROWS * shard : MIXED_ROWS * (shard + 1)])
    layer.process_weights_after_loading()
    return layer


@pytest.mark.parametrize("num_tokens", [1, 9])
def test_merged_layer_of_mixed_types_keeps_each_shard_in_its_own(num_tokens: int) -> None:
    """q, k Q4_K and v Q6_K in one merged layer: the layer computes with the gguf package's weights, and reads what
    the three shards read as layers of their own (not q and k in v's 6-bit codes and groups of 16)."""
    blocks = mixed_shards(num_tokens)
    bias = torch.randn(3 * MIXED_ROWS)
    layer = gguf_layer(blocks, MIXED_SHARDS, bias)
    reference = torch.from_numpy(np.concatenate([dequantize(d, q) for d, q in zip(blocks, MIXED_SHARDS)]))
    x = torch.randn(num_tokens, MIXED_IN)
    kernels = layer.kernel.name.split("+")
    assert len(kernels) == 2  # q and k in one run, v in another
    runs = [reference[: 2 * MIXED_ROWS], reference[2 * MIXED_ROWS :]]  # each run's kernel sees x as it rounds it
    # (the panel kernel rounds x per 256 columns for the K-quants, which it keeps as super-blocks)
    seen = [int8_rows(x, SUPER_BLOCK) if k == "panels" else native_layer_input(x, kernel=k) for k in kernels]
    expected = torch.cat([rounded @ rows.t() for rounded, rows in zip(seen, runs)], 1) + bias
    # NOTE: int4pack rounds x and the scales to bfloat16; the other kernels are exact up to float32 rounding
    tolerance = 2e-2 if "int4pack" in kernels else 1e-5
    assert (layer(x) - expected).abs().max() <= tolerance * (x.abs() @ reference.abs().t()).max()
    own = sum(gguf_layer([data], [q]).kernel.weight_bytes() for data, q in zip(blocks, MIXED_SHARDS))
    assert layer.kernel.weight_bytes() == own + bias.nbytes
    weights = [decode_blocks(data, q, (MIXED_ROWS, MIXED_IN)) for data, q in zip(blocks, MIXED_SHARDS)]
    widened = select_kernel(RowShards(weights, 6, 16), torch.device("cpu"), torch.float32, TORCH_OPS)
    assert layer.kernel.weight_bytes() < widened.weight_bytes()  # what one kernel of the widest shard's codes read


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")
def test_q4_1_layer_on_the_gpu_keeps_float_zero_points() -> None:
    """bfloat16 scales, float32 zero points (a bf16 zero point ~150 codes off would be off by ~0.5)."""
    rng = np.random.default_rng(0)
    values = rng.normal(size=(64, 256)).astype(np.float32)
    values[:, :32] += 5.0  # all-positive blocks: zero points far below the codes
    data = quantize(values, Q.Q4_1)
    layer = Linear(256, [64]).cuda().to(torch.bfloat16)
    layer.set_format(GGUFMethod(4))
    weight = decode_blocks(data, Q.Q4_1, (64, 256))
    for name in ("codes", "scales", "zeros"):
        layer.load_shard(name, 0, getattr(weight, name))
    layer.process_weights_after_loading()
    assert layer.w_zeros.dtype == torch.float32
    x = torch.randn(5, 256)
    reference = torch.from_numpy(dequantize(data, Q.Q4_1))
    out = layer(x.cuda().bfloat16()).float().cpu()
    assert ((out - x @ reference.t()).abs() <= 2e-2 * (x.abs() @ reference.abs().t()) + 2e-2).all()
