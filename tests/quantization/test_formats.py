"""Checkpoint formats: GPTQ and AWQ tensors built here from known integers dequantize exactly."""

from __future__ import annotations

import pytest
import torch

from kvforge.layers.linear import Linear
from kvforge.quantization.formats import AWQ_ORDER, AWQMethod, GPTQMethod, pack_int32, unpack_int32
from kvforge.quantization.quantized_weight import QuantizedWeight
from tests.kernels.cpu.test_quant_gemv_cpu import native_layer_input


def _pack_gptq_by_hand(codes_kn: torch.Tensor, bits: int) -> torch.Tensor:
    """AutoGPTQ's packer, written out: word i of column n holds features i * pack .. i * pack + pack - 1."""
    pack = 32 // bits
    words = torch.zeros(codes_kn.shape[0] // pack, codes_kn.shape[1], dtype=torch.int64)
    for i in range(words.shape[0]):
        for j in range(pack):
            words[i] |= codes_kn[i * pack + j].to(torch.int64) << (bits * j)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_int32_matches_the_reference_packer_and_round_trips(bits: int) -> None:
    codes = torch.randint(0, 2**bits, (64, 24))
    packed = pack_int32(codes, bits, dim=0)
    assert torch.equal(packed, _pack_gptq_by_hand(codes, bits))
    assert torch.equal(unpack_int32(packed, bits, dim=0), codes)
    assert torch.equal(unpack_int32(pack_int32(codes, bits, dim=1), bits, dim=1), codes)


def test_awq_order_puts_column_order_i_in_nibble_i() -> None:
    codes = torch.arange(8).repeat(3, 1)  # [K=3, N=8], column c holds c
    word = pack_int32(codes, 4, dim=1, order=AWQ_ORDER)[0, 0].item() & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == list(AWQ_ORDER)


def _converted_weights(layer: Linear) -> list[QuantizedWeight]:
    """The QuantizedWeight the layer's method converts its checkpoint tensors into, once the last shard is in."""
    seen: list[QuantizedWeight] = []
    convert = layer.format.to_quantized_weight
    layer.format.to_quantized_weight = lambda layer: seen.append(convert(layer)) or seen[-1]
    return seen


def _gptq_layer(
    shards: list[int], in_features: int, bits: int, group_size: int, fmt: str, act_order: bool
) -> tuple[Linear, torch.Tensor, list[QuantizedWeight]]:
    """A merged Linear loaded from per-shard GPTQ tensors; returns it, the expected float weight and the weight its
    method converted."""
    layer = Linear(in_features, shards)
    layer.set_format(GPTQMethod(bits, group_size, fmt))
    converted = _converted_weights(layer)
    num_groups = in_features // group_size
    expected = []
    g_idx = torch.arange(in_features, dtype=torch.int32) // group_size
    if act_order:
        g_idx = g_idx[torch.randperm(in_features)]
    for shard, rows in enumerate(shards):
        codes = torch.randint(0, 2**bits, (in_features, rows))
        zeros = torch.randint(1 if fmt == "gptq" else 0, 2**bits, (num_groups, rows))  # v1 cannot store 0
        scales = torch.rand(num_groups, rows) + 0.1
        stored_zeros = zeros - 1 if fmt == "gptq" else zeros  # v1 stores zero - 1
        layer.load_shard("qweight", shard, _pack_gptq_by_hand(codes, bits))
        layer.load_shard("qzeros", shard, pack_int32(stored_zeros.t(), bits, dim=0).t().contiguous())
        layer.load_shard("scales", shard, scales)
        layer.load_shard("g_idx", shard, g_idx)
        expected.append(((codes - zeros[g_idx.long()]) * scales[g_idx.long()]).t())
    return layer, torch.cat(expected), converted


@pytest.mark.parametrize(
    "bits,fmt,act_order",
    [(4, "gptq", False), (4, "gptq", True), (8, "gptq", True), (4, "gptq_v2", False), (8, "gptq_v2", False)],
)
def test_gptq_checkpoint_dequantizes_exactly(bits: int, fmt: str, act_order: bool) -> None:
    torch.manual_seed(0)
    layer, expected, converted = _gptq_layer([32, 16, 16], 128, bits, 32, fmt, act_order)
    (weight,) = converted  # converted once, when the last shard came in
    assert torch.equal(weight.dequantize(), expected)
    assert (weight.perm is not None) == act_order
    layer.process_weights_after_loading()  # a second call does nothing
    x = torch.randn(3, 128)
    x_seen = native_layer_input(x, weight.perm, layer.kernel.name)  # the C++ kernels round x to int8 per 32 columns
    torch.testing.assert_close(layer(x), x_seen @ expected.t(), rtol=2e-2, atol=2e-2 * expected.abs().max().item())


def test_awq_checkpoint_dequantizes_exactly() -> None:
    torch.manual_seed(0)
    layer = Linear(64, [16, 32])
    layer.set_format(AWQMethod(4, 32))
    converted = _converted_weights(layer)
    expected = []
    for shard, rows in enumerate([16, 32]):
        codes, zeros = torch.randint(0, 16, (64, rows)), torch.randint(0, 16, (2, rows))
        scales = torch.rand(2, rows) + 0.1
        layer.load_shard("qweight", shard, pack_int32(codes, 4, dim=1, order=AWQ_ORDER))
        layer.load_shard("qzeros", shard, pack_int32(zeros, 4, dim=1, order=AWQ_ORDER))
        layer.load_shard("scales", shard, scales)
        groups = torch.arange(64) // 32
        expected.append(((codes - zeros[groups]) * scales[groups]).t())
    assert torch.equal(converted[0].dequantize(), torch.cat(expected))


def test_gptq_shards_with_different_g_idx_are_rejected() -> None:
    layer = Linear(64, [16, 16])
    layer.set_format(GPTQMethod(4, 32))
    layer.load_shard("g_idx", 0, torch.arange(64, dtype=torch.int32) // 32)
    with pytest.raises(ValueError, match="different g_idx"):
        layer.load_shard("g_idx", 1, torch.arange(64, dtype=torch.int32).flip(0) // 32)
