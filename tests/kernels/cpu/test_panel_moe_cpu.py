"""kvforge::panel_moe (kernels/cpu/panel_moe.py), the MoE of experts packed for the panel kernel: against the MoE of
the dequantized experts with each product's input rounded to int8 as the kernel rounds it (pairs of other ranks'
experts, -1, adding nothing, experts without tokens), and the same under torch.compile with fullgraph=True (one
opaque op, where the experts' host syncs broke the graph)."""

from __future__ import annotations

import pytest
import torch

import kvforge.kernels.cpu.panel_moe  # noqa: F401  (registers the op)
from kvforge.kernels.activation import silu_and_mul_ref
from kvforge.kernels.cpu.quant_panels import int8_rows, pack_panels, panels_available
from tests.kernels.cpu.test_quant_gemv_cpu import _weight

pytestmark = pytest.mark.skipif(not panels_available(), reason="the panel kernel needs AVX-512 VNNI")
EXPERTS, HIDDEN, INTER, TOKENS, TOP_K = 5, 96, 64, 7, 2


def _reference(x, w13, w2, weights, ids) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float64)
    for token in range(ids.shape[0]):
        for slot in range(ids.shape[1]):
            expert = int(ids[token, slot])
            if expert < 0:
                continue
            act = silu_and_mul_ref(int8_rows(x[token : token + 1]).double() @ w13[expert].t())
            out[token] += weights[token, slot] * (int8_rows(act).double() @ w2[expert].t())[0]
    return out


def test_panel_moe_is_the_moe_of_the_dequantized_experts() -> None:
    """4-bit gate/up (a Q4 file's) and 6-bit down in groups of 16 (Q6_K, as a Q4_K_M file's experts)."""
    gate_up_bits, down_bits = 4, 6
    gate_up = [_weight(2 * INTER, HIDDEN, gate_up_bits, 32, "float", seed=e) for e in range(EXPERTS)]
    down = [_weight(HIDDEN, INTER, down_bits, 16 if down_bits == 6 else 32, "sym", seed=10 + e) for e in range(EXPERTS)]
    packed13 = [pack_panels(w.codes, w.scales, w.zeros, gate_up_bits) for w in gate_up]
    packed2 = [pack_panels(w.codes, w.scales, w.zeros, down_bits) for w in down]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(EXPERTS - 1, generator=gen)[:TOP_K] for _ in range(TOKENS)])  # expert 4: none
    ids[2, 1] = -1  # another rank's expert
    weights = torch.rand(TOKENS, TOP_K, generator=gen)

    def moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.kvforge.panel_moe(x, weights, ids, [p[0] for p in packed13], [p[0] for p in packed2],
                                           [p[1] for p in packed13], [p[1] for p in packed2], gate_up_bits, down_bits,
                                           2 * INTER)  # fmt: skip

    expected = _reference(x, [w.dequantize().double() for w in gate_up], [w.dequantize().double() for w in down],
                          weights, ids)  # fmt: skip
    out = moe(x, weights, ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    # NOTE: the panels keep half scales: each product within about 2e-4 of its largest value (test_quant_panels_cpu)
    error = (out.double() - expected).abs().max() / expected.abs().max()
    assert error < 2e-3, error
    compiled = torch.compile(moe, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, weights, ids), out, rtol=0, atol=0)
