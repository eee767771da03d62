"""Fused MoE: moe_align, the Triton grouped-GEMM kernel and the CPU path against the per-expert reference,
with uneven expert loads (experts without tokens, one expert with every token, pairs of other ranks)."""

from __future__ import annotations

import pytest
import torch

from kvforge.kernels.fused_moe import fused_moe_cpu, fused_moe_per_expert, fused_moe_ref, fused_moe_triton
from kvforge.kernels.moe_align import max_aligned_blocks, moe_align

# Measured (|out| up to ~2.6): fp32 <= 1.5e-6; fp16 <= 2e-3 and bf16 <= 3.1e-2, i.e. 2 ulp: the kernel
# rounds the gate-up product to the half type before the activation, the reference does not.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 6e-2}


def _routing(name: str, num_tokens: int, num_experts: int, top_k: int) -> torch.Tensor:
    """topk_ids [num_tokens, top_k]: distinct experts per token."""
    ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)])
    if name == "one_expert_takes_all":  # expert 3 gets every token; slot 1 only ever uses experts 0-1
        ids[:, 0] = 3
        ids[:, 1:] = torch.randint(0, 2, (num_tokens, top_k - 1))
    elif name == "other_ranks":  # experts 4+ live on another rank: -1
        ids = torch.where(ids < 4, ids, -1)
    return ids


def _problem(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int, routing: str,
             dtype: torch.dtype, device: torch.device):  # fmt: skip
    hidden_states = torch.randn(num_tokens, hidden).to(device, dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden) / hidden**0.5).to(device, dtype)
    w2 = (torch.randn(num_experts, hidden, inter) / inter**0.5).to(device, dtype)
    topk_weights = torch.rand(num_tokens, top_k).to(device)
    topk_ids = _routing(routing, num_tokens, num_experts, top_k).to(device)
    return hidden_states, w13, w2, topk_weights, topk_ids


def test_moe_align_groups_pairs_by_expert() -> None:
    topk_ids = torch.tensor([[0, 2], [0, 2], [2, 0], [-1, 2]])
    sorted_pair_ids, block_expert_ids = moe_align(topk_ids, num_experts=4, block_m=4)
    pad = 8  # num_pairs
    assert sorted_pair_ids.tolist()[:8] == [0, 2, 5, pad, 1, 3, 4, 7]
    assert set(sorted_pair_ids.tolist()[8:]) == {pad}
    assert block_expert_ids.tolist() == [0, 2, -1, -1, -1]
    assert len(block_expert_ids) == max_aligned_blocks(8, 4, 4)


@pytest.mark.parametrize("routing", ["random", "one_expert_takes_all", "other_ranks"])
def test_moe_align_covers_every_local_pair_once(routing: str) -> None:
    topk_ids = _routing(routing, 37, 8, 3)
    block_m = 16
    sorted_pair_ids, block_expert_ids = moe_align(topk_ids, 8, block_m)
    flat = topk_ids.reshape(-1)
    rows = sorted_pair_ids.view(-1, block_m)
    real = rows < flat.numel()
    assert sorted(rows[real].tolist()) == (flat >= 0).nonzero().flatten().tolist()
    for block, expert in enumerate(block_expert_ids.tolist()):  # each block holds one expert's pairs
        pairs = rows[block][real[block]].long()
        assert (flat[pairs] == expert).all() if expert >= 0 else pairs.numel() == 0


@pytest.mark.parametrize("routing", ["random", "one_expert_takes_all", "other_ranks"])
@pytest.mark.parametrize(
    "num_tokens, hidden, inter, num_experts, top_k",
    [(1, 64, 32, 8, 2), (23, 40, 24, 8, 3), (70, 64, 48, 6, 2)],
    ids=["decode", "odd-sizes", "more-rows-than-a-block"],
)
def test_triton_matches_reference(device, routing, num_tokens, hidden, inter, num_experts, top_k) -> None:
    args = _problem(num_tokens, hidden, inter, num_experts, top_k, routing, torch.float32, device)
    torch.testing.assert_close(fused_moe_triton(*args), fused_moe_ref(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_half_precision(device, dtype) -> None:
    args = _problem(19, 64, 32, 8, 2, "one_expert_takes_all", dtype, device)
    tol = TOLERANCE[dtype]
    expected = fused_moe_ref(*args).float()
    torch.testing.assert_close(fused_moe_triton(*args).float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("routing", ["random", "one_expert_takes_all", "other_ranks"])
@pytest.mark.parametrize("hidden, inter", [(64, 32), (30, 10)], ids=["grouped-mm", "unaligned-fallback"])
def test_cpu_path_matches_reference(routing, hidden, inter) -> None:
    args = _problem(33, hidden, inter, 8, 2, routing, torch.float32, torch.device("cpu"))
    torch.testing.assert_close(fused_moe_cpu(*args), fused_moe_ref(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("routing", ["random", "one_expert_takes_all", "other_ranks"])
def test_per_expert_path_matches_reference(routing) -> None:
    """Each expert's own multiplies (here its float matrices') over the tokens routed to it."""
    hidden_states, w13, w2, topk_weights, topk_ids = _problem(33, 64, 32, 8, 2, routing, torch.float32,
                                                              torch.device("cpu"))  # fmt: skip
    gate_up, down = ([lambda x, w=w: x @ w.t() for w in weights] for weights in (w13, w2))
    ours = fused_moe_per_expert(hidden_states, topk_weights, topk_ids, gate_up, down)
    expected = fused_moe_ref(hidden_states, w13, w2, topk_weights, topk_ids)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_reference_is_the_expert_mlp_sum() -> None:
    """The reference against its definition, one (token, expert) pair at a time."""
    hidden_states, w13, w2, topk_weights, topk_ids = _problem(5, 16, 8, 4, 2, "random", torch.float64,
                                                              torch.device("cpu"))  # fmt: skip
    expected = torch.zeros_like(hidden_states)
    for token in range(5):
        for slot in range(2):
            gate, up = (w13[topk_ids[token, slot]] @ hidden_states[token]).chunk(2)
            act = torch.nn.functional.silu(gate) * up
            expected[token] += topk_weights[token, slot] * (w2[topk_ids[token, slot]] @ act)
    ours = fused_moe_ref(hidden_states, w13, w2, topk_weights, topk_ids)  # computed in fp32
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_launcher_rejects_bad_inputs(device) -> None:
    hidden_states, w13, w2, topk_weights, topk_ids = _problem(4, 16, 8, 4, 2, "random", torch.float32, device)
    with pytest.raises(ValueError, match="w2"):
        fused_moe_triton(hidden_states, w13, w2[:, :, :4], topk_weights, topk_ids)
    with pytest.raises(ValueError, match="topk_weights"):
        fused_moe_triton(hidden_states, w13, w2, topk_weights[:, :1], topk_ids)


def test_custom_op_passes_opcheck(device) -> None:
    args = _problem(6, 32, 16, 4, 2, "other_ranks", torch.float32, device)
    torch.library.opcheck(torch.ops.kvforge.fused_moe, args, test_utils=("test_schema", "test_faketensor"))
