"""LoRA of routed experts inside the fused MoE: the reference against each pair's merged expert weights (W + B A),
and the CPU path (grouped matmuls, and the gathered form a compiled step traces), the Triton kernels and the custom
op against the reference; pairs without an adapter, and of other ranks' experts, take no update."""

from __future__ import annotations

import pytest
import torch

from kvforge.kernels.fused_moe import _gathered_moe, fused_moe_cpu, fused_moe_ref, fused_moe_triton
from kvforge.kernels.moe_lora import ExpertLoRA
from tests.kernels.test_fused_moe import _problem


def _lora(num_tokens: int, hidden: int, inter: int, num_experts: int, num_slots: int, rank: int,
          dtype: torch.dtype, device) -> ExpertLoRA:  # fmt: skip
    """Random slots (every rank column used) and token slots with both -1 and every slot."""
    a13 = torch.randn(num_slots, num_experts, rank, hidden) / hidden**0.5
    b13 = torch.randn(num_slots, num_experts, 2 * inter, rank) / rank**0.5
    a2 = torch.randn(num_slots, num_experts, rank, inter) / inter**0.5
    b2 = torch.randn(num_slots, num_experts, hidden, rank) / rank**0.5
    token_slots = torch.arange(num_tokens) % (num_slots + 1) - 1  # -1, 0, 1, ..., -1, 0, ...
    return ExpertLoRA(*(t.to(device, dtype) for t in (a13, b13, a2, b2)), token_slots.to(device))


def test_reference_is_each_pairs_merged_expert() -> None:
    """Each (token, expert) pair runs its expert with the weights its adapter's merge would give: W + B A."""
    hidden, w13, w2, topk_weights, topk_ids = _problem(7, 16, 8, 4, 2, "other_ranks", torch.float64, "cpu")
    lora = _lora(7, 16, 8, 4, 2, 3, torch.float64, "cpu")
    expected = torch.zeros_like(hidden)
    for token in range(7):
        slot = lora.token_slots[token]
        for k in range(2):
            expert = topk_ids[token, k]
            if expert < 0:
                continue
            up_w, down_w = w13[expert], w2[expert]
            if slot >= 0:
                up_w = up_w + lora.b13[slot, expert] @ lora.a13[slot, expert]
                down_w = down_w + lora.b2[slot, expert] @ lora.a2[slot, expert]
            gate, up = (up_w @ hidden[token]).chunk(2)
            expected[token] += topk_weights[token, k] * (down_w @ (torch.nn.functional.silu(gate) * up))
    ours = fused_moe_ref(hidden, w13, w2, topk_weights, topk_ids, lora)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours, fused_moe_ref(hidden, w13, w2, topk_weights, topk_ids), atol=1e-3)


@pytest.mark.parametrize("routing", ["random", "other_ranks"])
@pytest.mark.parametrize("rank", [8, 5], ids=["grouped-mm", "unaligned-fallback"])
def test_cpu_path_matches_reference(routing: str, rank: int) -> None:
    args = _problem(29, 64, 32, 8, 2, routing, torch.float32, "cpu")
    lora = _lora(29, 64, 32, 8, 3, rank, torch.float32, "cpu")
    expected = fused_moe_ref(*args, lora)
    torch.testing.assert_close(fused_moe_cpu(*args, lora), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_gathered_moe(*args, lora), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("num_tokens", "hidden", "inter", "rank"), [(1, 64, 32, 8), (23, 40, 24, 5)],
                         ids=["decode", "odd-sizes"])
@pytest.mark.parametrize("routing", ["random", "other_ranks"])
def test_triton_matches_reference(device, num_tokens, hidden, inter, rank, routing) -> None:
    args = _problem(num_tokens, hidden, inter, 6, 2, routing, torch.float32, device)
    lora = _lora(num_tokens, hidden, inter, 6, 2, rank, torch.float32, device)
    torch.testing.assert_close(fused_moe_triton(*args, lora), fused_moe_ref(*args, lora), atol=1e-5, rtol=1e-5)


def test_custom_op_takes_the_slots_and_checks_them(device) -> None:
    args = _problem(5, 32, 16, 4, 2, "random", torch.float32, device)
    lora = _lora(5, 32, 16, 4, 2, 4, torch.float32, device)
    torch.library.opcheck(torch.ops.kvforge.fused_moe, (*args, *lora), test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(ValueError, match="lora b2"):
        fused_moe_triton(*args, lora._replace(b2=lora.b2[:, :, :, :2]))
