"""Batched LoRA shrink and expand (Triton, and the CPU's one-GEMM path) against the gather reference, the C++ CPU
kernel of a whole LoRA layer's update (rows grouped by adapter) against its reference, and the references against
plain per-row matrix products."""

from __future__ import annotations

import pytest
import torch

from kvforge.kernels.cpu.extension import cpu_kernels
from kvforge.kernels.cpu.lora import lora_fused_cpu
from kvforge.kernels.lora import (
    fused_width,
    lora_expand_cpu,
    lora_expand_ref,
    lora_expand_triton,
    lora_fused_ref,
    lora_shrink_cpu,
    lora_shrink_ref,
    lora_shrink_triton,
)

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2}


def _case(num_rows: int, dim: int, rank: int, num_out: int, num_slots: int, dtype: torch.dtype, device):
    x = torch.randn(num_rows, dim).to(device, dtype)
    a = (torch.randn(num_slots, rank, dim) / dim**0.5).to(device, dtype)
    b = torch.randn(num_slots, num_out, rank).to(device, dtype)
    y = torch.randn(num_rows, num_out).to(device, dtype)
    slots = torch.randint(-1, num_slots, (num_rows,), device=device)
    slots[0] = -1  # a row without an adapter, always
    return x, a, b, y, slots


def test_reference_is_each_rows_own_adapter() -> None:
    x, a, b, y, slots = _case(9, 33, 5, 17, 3, torch.float32, "cpu")
    h, out = lora_shrink_ref(x, a, slots), lora_expand_ref(lora_shrink_ref(x, a, slots), b, slots, y)
    for row, slot in enumerate(slots.tolist()):
        want = y[row] if slot < 0 else y[row] + (a[slot] @ x[row]) @ b[slot].T
        torch.testing.assert_close(out[row], want, atol=1e-4, rtol=1e-4)
        assert slot >= 0 or not h[row].any()


@pytest.mark.parametrize("segmented", [False, True], ids=["per-row", "segmented"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_rows", "dim", "rank", "num_out", "num_slots"),
                         [(1, 64, 8, 64, 1), (7, 100, 24, 301, 4), (13, 257, 3, 130, 3), (70, 48, 16, 40, 3)])
def test_triton_matches_reference(device, dtype, num_rows, dim, rank, num_out, num_slots, segmented) -> None:
    """Both Triton forms: one program per row (BGMV), and the rows segmented by adapter (SGMV; 70 rows: several
    blocks of one adapter)."""
    x, a, b, y, slots = _case(num_rows, dim, rank, num_out, num_slots, dtype, device)
    tol = TOLERANCE[dtype]
    h = lora_shrink_triton(x, a, slots, segmented)
    torch.testing.assert_close(h, lora_shrink_ref(x, a, slots), atol=tol, rtol=tol)
    out = lora_expand_triton(h, b, slots, y, segmented)
    torch.testing.assert_close(out, lora_expand_ref(h, b, slots, y), atol=tol, rtol=tol)
    assert torch.equal(out[0], y[0])  # the row without an adapter is left as it was


@pytest.mark.parametrize("segmented", [False, True], ids=["per-row", "segmented"])
@pytest.mark.parametrize(("num_rows", "dim", "rank", "num_out", "num_slots"), [(7, 100, 24, 301, 4),
                                                                                (70, 48, 16, 40, 3)])
def test_triton_reads_16_bit_weights_beside_float32_rows(device, num_rows, dim, rank, num_out, num_slots,
                                                         segmented) -> None:
    """lora_dtype bfloat16 under a float32 model: the weights widened as they are read, the sums in float32."""
    x, a, b, y, slots = _case(num_rows, dim, rank, num_out, num_slots, torch.float32, device)
    a, b = a.bfloat16(), b.bfloat16()
    h = lora_shrink_triton(x, a, slots, segmented)
    assert h.dtype == torch.float32
    torch.testing.assert_close(h, lora_shrink_ref(x, a, slots), atol=1e-4, rtol=1e-4)
    out = lora_expand_triton(h, b, slots, y, segmented)
    torch.testing.assert_close(out, lora_expand_ref(h, b, slots, y), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_rows", "num_slots"), [(1, 1), (11, 4)])
def test_cpu_path_matches_reference(num_rows: int, num_slots: int, weight_dtype: torch.dtype) -> None:
    x, a, b, y, slots = _case(num_rows, 45, 6, 29, num_slots, torch.float32, "cpu")
    a, b = a.to(weight_dtype), b.to(weight_dtype)
    h = lora_shrink_cpu(x, a, slots)
    torch.testing.assert_close(h, lora_shrink_ref(x, a, slots), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lora_expand_cpu(h, b, slots, y), lora_expand_ref(h, b, slots, y), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(cpu_kernels() is None, reason="the C++ CPU kernels are not built")
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_rows", "dim", "rank", "num_outs", "num_slots"),
                         [(2, 64, 8, (64,), 1), (16, 100, 16, (96, 32, 32), 4), (13, 257, 3, (130, 7), 3),
                          (300, 48, 5, (41,), 2)])
def test_cpu_fused_kernel_matches_reference(num_rows, dim, rank, num_outs, num_slots, weight_dtype) -> None:
    """A merged layer's matrices (q/k/v: three, gate/up: two) in one op, in place; odd sizes (columns past the last
    16-float vector), rows of every slot and of none, several tasks of one adapter (300 rows); the weights in float32
    or 16 bits (widened in registers, float32 sums: the reference widens the same 16-bit values)."""
    x, _, _, y, slots = _case(num_rows, dim, len(num_outs) * rank, sum(num_outs), num_slots, torch.float32, "cpu")
    slots[-1] = num_slots - 1  # a row with an adapter, always
    a = (torch.randn(num_slots, len(num_outs) * rank, dim) / dim**0.5).to(weight_dtype)
    at = torch.zeros(num_slots, dim, fused_width(a.shape[1]), dtype=weight_dtype)  # A^T, padded to whole vectors
    at[:, :, : a.shape[1]] = a.transpose(1, 2)
    bt = [torch.randn(num_slots, rank, n).to(weight_dtype) for n in num_outs]
    want = lora_fused_ref(x, y.clone(), at, bt, slots)
    got = y.clone()
    assert lora_fused_cpu(x, got, at, bt, slots) is got  # updated in place
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[slots < 0], y[slots < 0])  # rows of the base model are left as they were
    row = num_rows - 1  # the reference against plain products, for a row with an adapter
    h = a[slots[row]].float() @ x[row]
    plain = torch.cat([h[m * rank : (m + 1) * rank] @ b[slots[row]].float() for m, b in enumerate(bt)])
    torch.testing.assert_close(want[row], y[row] + plain, atol=1e-4, rtol=1e-4)


def test_launcher_names_a_bad_tensor(device) -> None:
    x, a, _, _, slots = _case(4, 16, 4, 8, 2, torch.float32, device)
    with pytest.raises(ValueError, match="slots"):
        lora_shrink_triton(x, a, slots[:3])
    with pytest.raises(ValueError, match="a must have shape"):
        lora_shrink_triton(x, a[:, :, :8], slots)
