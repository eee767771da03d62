"""Many rows of x against a kept GGUF weight on a CPU that multiplies bfloat16 (kernels/cpu/panel_bf16.py): the
panel layout unpacked to bfloat16 is the layout's weight rounded to bfloat16, and a layer's product from
UNPACK_MIN_ROWS rows on is the `gguf` package's dequantized weight times x, within bfloat16's rounding of x, of the
weight and of the product; below it (and at one row) the int8 panel kernel's bound holds as before. Odd shapes
(partial and padding panels, tiles of 1-4 panels, parts of several threads), every kept width (4, 6, 8 bits) in groups
of 32 and 16 columns, and two weights taking turns in one model's buffer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from kvforge.kernels.cpu.panel_bf16 import UNPACK_MIN_ROWS, unpack_available, unpack_bf16
from kvforge.kernels.cpu.quant_panels import int8_rows, pack_panels, panel_rows
from kvforge.kernels.ops import TORCH_OPS
from kvforge.quantization.gguf_blocks import BLOCK_LAYOUTS, decode_blocks
from kvforge.quantization.weight_only_kernels import PanelArena, select_kernel
from tests.kernels.cpu.test_quant_gemv_cpu import _weight
from tests.quantization.test_gguf_blocks import random_blocks

pytestmark = pytest.mark.skipif(not unpack_available(), reason="needs AVX-512 and a CPU that multiplies bfloat16")

# (rows, columns, group size): a partial last panel (37, 100), one tile of 1-4 panels against parts of 2-3 threads
SHAPES = [(37, 128, 32), (100, 256, 16), (140, 576, 32), (33, 96, 16), (16, 64, 32)]
# K-quant rows are whole blocks of 256 columns; 100 rows end in a partial panel, 17 in one of 1 row
GGUF_TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q3_K, Q.Q2_K, Q.Q8_0, Q.Q4_0, Q.Q4_1]


@pytest.mark.parametrize("bits", [8, 6, 4])
@pytest.mark.parametrize("num_rows,in_features,group_size", SHAPES)
@pytest.mark.parametrize("zeros", ["sym", "float"])
@pytest.mark.parametrize("parts", [1, 3])
def test_unpacked_weight_is_the_layout_rounded_to_bfloat16(bits: int, num_rows: int, in_features: int,
                                                          group_size: int, zeros: str, parts: int) -> None:
    """W^T in bfloat16: each weight within bfloat16's rounding (2^-9) of the layout's rows (panel_rows, the
    reference of the layout), and no row or column misplaced."""
    weight = _weight(num_rows, in_features, bits, group_size, zeros, seed=num_rows + bits)
    packed, factor = pack_panels(weight.codes, weight.scales, weight.zeros, bits, parts=parts)
    unpacked = unpack_bf16(packed, factor, bits, num_rows)
    assert unpacked.shape == (in_features, num_rows) and unpacked.dtype == torch.bfloat16
    expected = panel_rows(packed, factor, bits, torch.arange(num_rows)).t()
    assert ((unpacked.float() - expected).abs() <= 2**-9 * expected.abs() + 1e-7).all()


def _bf16_bound(x: torch.Tensor, dense: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """x and the weight each rounded to bfloat16 (2^-9 of each term, so 2^-8 of the sum of the terms' magnitudes),
    float32 sums, the product rounded to bfloat16 (2^-9 of it)."""
    return 2**-8 * (x.abs().double() @ dense.abs().double().t()) + 2**-8 * reference.abs() + 1e-6


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("num_rows", [100, 17])
def test_kept_gguf_layer_against_gguf_dequantize(qtype: Q, num_rows: int) -> None:
    """A kept layer (its kernel and the model's buffer as the loader makes them) against x @ gguf's dequantized
    weight: the bfloat16 bound from UNPACK_MIN_ROWS rows of x, the int8 one below (x rounded per 32 columns)."""
    rng = np.random.default_rng([int(qtype), num_rows])
    shape = (num_rows, 2 * max(256, BLOCK_LAYOUTS[qtype].block_size))
    data = random_blocks(rng, qtype, shape)
    dense = torch.from_numpy(dequantize(data, qtype).reshape(shape)).float()
    arena = PanelArena(parts=2, region_bytes=1 << 20, huge_pages=False)
    kernel = select_kernel(decode_blocks(data, qtype, shape), torch.device("cpu"), torch.float32, TORCH_OPS,
                           arena=arena)
    assert kernel.name == "panels" and kernel.unpacks
    for rows in (1, UNPACK_MIN_ROWS - 1, UNPACK_MIN_ROWS, 3 * UNPACK_MIN_ROWS + 5):
        x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
        out = kernel.apply(x).double()
        if rows >= UNPACK_MIN_ROWS:
            reference = x.double() @ dense.double().t()
            bound = _bf16_bound(x, dense, reference)
        else:  # the int8 kernel: x rounded per 32 columns, the weight's half scales (2^-11 of each term)
            seen = int8_rows(x).double()
            reference = seen @ dense.double().t()
            bound = (2**-11 + 5e-7) * (seen.abs() @ dense.abs().double().t()) + 1e-5
        assert out.shape == (rows, num_rows)
        assert ((out - reference).abs() <= bound).all(), (rows, (out - reference).abs().max().item())


def test_weights_take_turns_in_one_buffer() -> None:
    """Two kept layers of one model unpack into the same memory in turn (as a model's layers run), each call's
    product its own weight's; a larger weight grows the memory for both."""
    arena = PanelArena(parts=2, region_bytes=1 << 20, huge_pages=False)
    small = _weight(48, 256, 4, 32, "float", seed=1)
    large = _weight(200, 512, 6, 16, "sym", seed=2)
    kernels = [select_kernel(w, torch.device("cpu"), torch.float32, TORCH_OPS, arena=arena) for w in (small, large)]
    for kernel, weight in [*zip(kernels, (small, large)), *zip(kernels, (small, large))]:
        x = torch.randn(UNPACK_MIN_ROWS + 3, weight.codes.shape[1], generator=torch.Generator().manual_seed(0))
        dense = weight.dequantize()
        reference = x.double() @ dense.double().t()
        assert ((kernel.apply(x).double() - reference).abs() <= _bf16_bound(x, dense, reference)).all()
    assert kernels[0].unpack_buffer is kernels[1].unpack_buffer is arena.unpack_buffer
