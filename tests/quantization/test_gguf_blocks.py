"""Every GGUF block layout decoded into codes, scales and zero points gives back the `gguf` package's own
dequantized values: on data gguf quantizes itself (the types it can quantize) and on random raw blocks
(all types: random bits, with finite float16 d / m / dmin fields).

Bound: types with integer zero points match bit for bit; those with float zero points (Q4_1, Q5_1, Q4_K,
Q5_K, Q2_K) to within 4 float32 ulps of the terms, |ours - gguf| <= 2**-22 * |scale| * (code + |zero|),
i.e. rtol 2.4e-7 of the larger of |scale * code| and |scale * zero|."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from kvforge.kernels.cpu.extension import cpu_kernels
from kvforge.quantization.gguf_blocks import BLOCK_LAYOUTS, decode_blocks, decode_blocks_ref

EXACT = {Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.IQ4_NL, Q.Q6_K, Q.Q3_K, Q.IQ4_XS}
# byte offsets of each type's float16 fields (d first, then m or dmin)
HALF_FIELDS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.IQ4_NL: (0,),
               Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q3_K: (108,), Q.Q2_K: (80, 82),
               Q.IQ4_XS: (0,)}  # fmt: skip
SHAPES = [(3, 256), (3, 512), (17, 256), (17, 512)]


def gguf_quantizes(qtype: Q) -> bool:
    try:
        quantize(np.zeros((1, 256), dtype=np.float32), qtype)
    except NotImplementedError:
        return False
    return True


QUANTIZED = [qtype for qtype in BLOCK_LAYOUTS if gguf_quantizes(qtype)]


def random_blocks(rng: np.random.Generator, qtype: Q, shape: tuple[int, int]) -> np.ndarray:
    """Random raw blocks [N, bytes] whose float16 fields lie in +-[0.01, 0.1] (d and dmin positive); the first
    block of row 0 has d = 0 (a constant block for Q4_1 / Q5_1, scale-0 sub-blocks for the K-quants)."""
    layout = BLOCK_LAYOUTS[qtype]
    blocks = rng.integers(0, 256, (shape[0], shape[1] // layout.block_size, layout.block_bytes), dtype=np.uint8)
    for field, offset in enumerate(HALF_FIELDS[qtype]):
        values = rng.uniform(0.01, 0.1, blocks.shape[:2])
        if field == 1 and qtype in (Q.Q4_1, Q.Q5_1):
            values *= rng.choice([-1, 1], blocks.shape[:2])  # m, a signed minimum
        blocks[..., offset : offset + 2] = values.astype(np.float16)[..., None].view(np.uint8)
    blocks[0, 0, HALF_FIELDS[qtype][0] : HALF_FIELDS[qtype][0] + 2] = 0
    return blocks.reshape(shape[0], -1)


def assert_matches_gguf(data: np.ndarray, qtype: Q, shape: tuple[int, int]) -> None:
    layout = BLOCK_LAYOUTS[qtype]
    weight = decode_blocks(data, qtype, shape)
    num_rows, in_features = shape
    num_groups = in_features // layout.group_size
    assert weight.codes.dtype == torch.uint8 and weight.codes.shape == shape
    assert weight.scales.dtype == weight.zeros.dtype == torch.float32
    assert weight.scales.shape == weight.zeros.shape == (num_rows, num_groups)
    assert weight.bits == layout.bits and int(weight.codes.max()) < 2**weight.bits
    ours, reference = weight.dequantize().numpy(), dequantize(data, qtype)
    if qtype in EXACT:
        np.testing.assert_array_equal(ours, reference)
        return
    grouped = weight.codes.reshape(num_rows, num_groups, -1).float()
    terms = (weight.scales.abs()[..., None] * (grouped + weight.zeros.abs()[..., None])).reshape(shape)
    assert (np.abs(ours - reference) <= 2.0**-22 * terms.numpy()).all()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", BLOCK_LAYOUTS, ids=lambda q: q.name)
def test_random_blocks_decode_to_gguf_values(qtype: Q, shape: tuple[int, int]) -> None:
    rng = np.random.default_rng([int(qtype), *shape])
    assert_matches_gguf(random_blocks(rng, qtype, shape), qtype, shape)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda q: q.name)
def test_quantized_weights_decode_to_gguf_values(qtype: Q, shape: tuple[int, int]) -> None:
    rng = np.random.default_rng([int(qtype), *shape])
    weights = rng.normal(size=shape).astype(np.float32)
    weights[0, :32] = 0.5  # a constant block: Q4_1 / Q5_1 store d = 0
    weights[1, :32] += 4.0  # all positive: zero points far below the codes
    assert_matches_gguf(quantize(weights, qtype), qtype, shape)


def test_registry_and_gguf_agree_on_block_sizes() -> None:
    assert {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0} <= set(QUANTIZED)
    for qtype, layout in BLOCK_LAYOUTS.items():
        assert (layout.block_size, layout.block_bytes) == GGML_QUANT_SIZES[qtype], qtype.name
        assert layout.bits in (4, 5, 6, 8) and layout.group_size in (16, 32)
        assert layout.block_size % layout.group_size == 0


def test_q6_k_negative_scales_are_kept() -> None:
    rng = np.random.default_rng(0)
    data = random_blocks(rng, Q.Q6_K, (2, 256))
    weight = decode_blocks(data, Q.Q6_K, (2, 256))
    assert (weight.scales < 0).any() and (weight.zeros == 32).all()  # q about the 6-bit layouts' zero point


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q6_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS], ids=lambda q: q.name)
def test_symmetric_types_take_the_zero_point_of_their_codes_width(qtype: Q) -> None:
    """8 for 4-bit codes, 32 for 6-bit, 128 for 8-bit: the panel kernel stores no offsets for such weights."""
    block_size = GGML_QUANT_SIZES[qtype][0]
    weight = decode_blocks(random_blocks(np.random.default_rng(2), qtype, (3, block_size)), qtype, (3, block_size))
    assert (weight.zeros == {4: 8, 6: 32, 8: 128}[weight.bits]).all()


def test_scale_zero_groups_hold_their_offset() -> None:
    """Q2_K sub-blocks with sc = 0 hold -dmin * m: stored as codes 0, zero -1, scale -dmin * m."""
    blocks = random_blocks(np.random.default_rng(1), Q.Q2_K, (1, 256)).reshape(1, 1, -1)
    blocks[0, 0, :16] = np.arange(16, dtype=np.uint8) << 4  # sc = 0, m = s
    blocks[0, 0, 80:82] = np.array([0.05], dtype=np.float16).view(np.uint8)  # d != 0
    data = blocks.reshape(1, -1)
    weight = decode_blocks(data, Q.Q2_K, (1, 256))
    assert (weight.codes == 0).all() and (weight.zeros == -1).all()
    np.testing.assert_array_equal(weight.dequantize().numpy(), dequantize(data, Q.Q2_K))


def test_decode_rejects_wrong_sizes_and_other_types() -> None:
    data = random_blocks(np.random.default_rng(2), Q.Q4_K, (2, 512))
    with pytest.raises(ValueError, match="of Q4_K blocks do not hold a 2x768 matrix"):
        decode_blocks(data, Q.Q4_K, (2, 768))
    with pytest.raises(ValueError, match="of Q4_K blocks do not hold a 4x128 matrix"):
        decode_blocks(data, Q.Q4_K, (4, 128))  # the right byte count, K not a multiple of 256
    for qtype in (Q.IQ2_XXS, Q.F16, Q.BF16):
        with pytest.raises(ValueError, match=f"GGUF type {qtype.name} has no block decoder"):
            decode_blocks(data, qtype, (2, 512))


def test_decoders_take_any_array_of_the_right_bytes() -> None:
    """A read-only, non-contiguous view of the blocks (as a memory-mapped file's tensor may be)."""
    data = random_blocks(np.random.default_rng(3), Q.Q5_K, (4, 256))
    view = np.repeat(data, 2, axis=0)[::2]
    view.flags.writeable = False
    weight, expected = decode_blocks(view, Q.Q5_K, (4, 256)), decode_blocks(data, Q.Q5_K, (4, 256))
    for name in ("codes", "scales", "zeros"):
        assert getattr(weight, name).is_contiguous() and torch.equal(getattr(weight, name), getattr(expected, name))


@pytest.mark.skipif(cpu_kernels() is None, reason="needs the C++ extension")
@pytest.mark.parametrize("qtype", BLOCK_LAYOUTS, ids=lambda q: q.name)
def test_the_extension_decodes_as_the_numpy_reference(qtype: Q) -> None:
    """The C++ decoder (the path the loader takes) gives the reference's bytes and float32 values, bit for bit."""
    layout, shape = BLOCK_LAYOUTS[qtype], (37, 512)
    data = random_blocks(np.random.default_rng(int(qtype)), qtype, shape)
    ours = decode_blocks(data, qtype, shape)
    reference = decode_blocks_ref(data.reshape(shape[0], -1, layout.block_bytes), layout)
    for name in ("codes", "scales", "zeros"):
        assert torch.equal(getattr(ours, name), getattr(reference, name)), name
