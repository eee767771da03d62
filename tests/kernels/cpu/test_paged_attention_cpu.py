"""The CPU attention paths (the C++ decode and prefill kernels, SDPA over gathered blocks) against the readable
reference."""

from __future__ import annotations

import random

import pytest
import torch

import kvforge.kernels.cpu.paged_attention as paged_attention_cpu_module
from kvforge.kernels.cpu.extension import cpu_kernels
from kvforge.kernels.cpu.paged_attention import DECODE_GROUP, paged_attention_cpu, paged_decode_cpu, paged_prefill_cpu
from kvforge.kernels.paged_attention import paged_attention_ref
from tests.kernels.attention_batches import TOLERANCE, dequantized_reference, make_paged_batch, quantize_batch_cache


@pytest.mark.parametrize("native", [True, False], ids=["cpp-decode", "sdpa-decode"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch_matches_reference(
    monkeypatch: pytest.MonkeyPatch, native: bool, dtype: torch.dtype, group: int, block_size: int
) -> None:
    if native:
        assert cpu_kernels() is not None, "the C++ CPU kernels failed to build"
    else:
        monkeypatch.setattr(paged_attention_cpu_module, "cpu_kernels", lambda: None)
    rng = random.Random(group * block_size)
    num_decodes = 2 * DECODE_GROUP + 3  # several length groups, the last one short
    decode_lens = [rng.randint(1, 200) for _ in range(num_decodes)]
    # prefills: fresh (q_len == seq_len), after a prefix ending mid-block, and a single long chunk
    q_lens = [1] * num_decodes + [37, 20, 5]
    seq_lens = decode_lens + [37, 20 + 45, 5 + 2 * block_size]
    batch = make_paged_batch(q_lens, seq_lens, num_heads=2 * group, num_kv_heads=2, head_dim=64,
                             block_size=block_size, dtype=dtype)
    # The torch paths read padded slots before masking them, so the (engine-like) cache stays finite.
    scale = 64**-0.5
    expected = paged_attention_ref(*batch.args(), scale)
    tol = TOLERANCE[dtype]
    got = paged_attention_cpu(*batch.args(), scale)
    if native:  # decode-only batches take the kernel's in-order fast path
        decode_only = make_paged_batch([1] * num_decodes, decode_lens, num_heads=2 * group, num_kv_heads=2,
                                       head_dim=64, block_size=block_size, dtype=dtype)
        torch.testing.assert_close(paged_attention_cpu(*decode_only.args(), scale).float(),
                                   paged_attention_ref(*decode_only.args(), scale).float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("code_dtype", [None, torch.int8, torch.float8_e4m3fn], ids=["float", "int8", "fp8"])
@pytest.mark.parametrize("seq_lens", [[1500], [700, 0, 65], [64, 129]], ids=["one-long", "padding-row", "edges"])
@pytest.mark.parametrize(("group", "head_dim", "block_size"), [(3, 64, 16), (7, 40, 16), (5, 128, 32), (1, 256, 8)],
                         ids=["g3-d64", "g7-d40", "g5-d128", "g1-d256"])
def test_few_long_decodes_split_their_context_and_match_the_reference(seq_lens, code_dtype, group, head_dim,
                                                                       block_size) -> None:
    """Fewer (sequence, kv head) pairs than the threads can share: the kernel cuts each context into parts and
    merges their softmaxes. Every slot outside the contexts is NaN (its scale, in a quantized cache), so reading
    past a context shows. Head groups and head dims that fill the kernel's register blocks partly (a group of 7
    is a block of 4 heads and one of 3; a head dim of 40 pads to 48) and tiles smaller and larger than a block."""
    assert cpu_kernels() is not None, "the C++ CPU kernels failed to build"
    batch = make_paged_batch([1] * len(seq_lens), [max(n, 1) for n in seq_lens], num_heads=2 * group, num_kv_heads=2,
                             head_dim=head_dim, block_size=block_size, dtype=torch.float32)
    scale = head_dim**-0.5
    key_scale = value_scale = None
    if code_dtype is None:
        expected = paged_attention_ref(*batch.args(), scale)  # (it reads padded slots before masking them)
        batch.poison_unused_slots()
    else:  # NaN scales outside the contexts
        batch, key_scale, value_scale = quantize_batch_cache(batch, code_dtype)
        expected = dequantized_reference(batch, key_scale, value_scale, scale)
    lens = torch.tensor(seq_lens, dtype=torch.int32)  # 0: a decode bucket's padding row, which outputs zeros
    got = paged_decode_cpu(batch.query, batch.key_cache, batch.value_cache, batch.block_tables, lens, scale,
                           key_scale, value_scale)
    expected = torch.where(lens[:, None, None] > 0, expected, 0.0)
    torch.testing.assert_close(got, expected, atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])


@pytest.mark.parametrize("code_dtype", [None, torch.int8, torch.float8_e4m3fn], ids=["float", "int8", "fp8"])
@pytest.mark.parametrize(("group", "head_dim", "block_size"), [(3, 64, 16), (7, 40, 8), (1, 128, 32), (16, 64, 16)],
                         ids=["g3-d64", "g7-d40-b8", "g1-d128-b32", "g16-d64"])
def test_prefill_kernel_matches_the_reference(code_dtype, group, head_dim, block_size) -> None:
    """Prompts fresh and after cached context (ending mid-block), longer than one tile of query rows, beside decodes
    whose rows the kernel leaves alone. Every slot outside the contexts is NaN (its scale, in a quantized cache), so
    reading past a context, or a key past a query's position, shows; a head dim of 40 pads to 48 in the kernel, a
    block of 8 tokens is half a key tile, and a group of 16 heads is one query token per 16 rows."""
    assert cpu_kernels() is not None, "the C++ CPU kernels failed to build"
    q_lens = [130, 1, 37, 2, 1, 70]
    seq_lens = [130, 50, 37 + 45, 2 + 3 * block_size, 9, 200]
    batch = make_paged_batch(q_lens, seq_lens, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                             block_size=block_size, dtype=torch.float32)
    scale = head_dim**-0.5
    key_scale = value_scale = None
    if code_dtype is None:
        expected = paged_attention_ref(*batch.args(), scale)
        batch.poison_unused_slots()
    else:
        batch, key_scale, value_scale = quantize_batch_cache(batch, code_dtype)
        expected = dequantized_reference(batch, key_scale, value_scale, scale)
    got = paged_prefill_cpu(*batch.args(), scale, key_scale, value_scale)
    starts = batch.query_start_loc.tolist()
    prefill_rows = torch.cat([torch.arange(starts[s], starts[s + 1]) for s, q in enumerate(q_lens) if q > 1])
    torch.testing.assert_close(got[prefill_rows], expected[prefill_rows], atol=TOLERANCE[torch.float32],
                               rtol=TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_kernel_in_half_precision(dtype: torch.dtype) -> None:
    assert cpu_kernels() is not None, "the C++ CPU kernels failed to build"
    batch = make_paged_batch([60, 33], [60, 33 + 20], num_heads=6, num_kv_heads=2, head_dim=64, block_size=16,
                             dtype=dtype)
    expected = paged_attention_ref(*batch.args(), 0.125)
    got = paged_prefill_cpu(*batch.args(), 0.125)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_prefill_kernel_rejects_a_context_its_block_table_cannot_hold() -> None:
    assert cpu_kernels() is not None, "the C++ CPU kernels failed to build"
    batch = make_paged_batch([20], [20], num_heads=2, num_kv_heads=1, head_dim=32, block_size=16,
                             dtype=torch.float32)
    with pytest.raises(RuntimeError, match="sequence 0 has 20 query tokens and 40 of context"):
        paged_prefill_cpu(batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.query_start_loc,
                          torch.tensor([40], dtype=torch.int32), 0.125)
