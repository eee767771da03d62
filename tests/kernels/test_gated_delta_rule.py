"""The gated delta rule: the chunked reference against transformers' token-by-token recurrence, and the Triton prefill
and decode kernels against the reference (in the interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

from kvforge.kernels.gated_delta_rule import (
    gated_delta_decode_ref,
    gated_delta_decode_triton,
    gated_delta_prefill_ref,
    gated_delta_prefill_triton,
)


def _inputs(num_tokens: int, heads: int, key_dim: int, value_dim: int, device: torch.device
            ) -> tuple[torch.Tensor, ...]:
    q = torch.randn(num_tokens, heads, key_dim, device=device)
    k = torch.randn(num_tokens, heads, key_dim, device=device)
    v = torch.randn(num_tokens, heads, value_dim, device=device)
    g = -torch.rand(num_tokens, heads, device=device) * 0.5  # log decays, as -exp(A_log) * softplus(a + dt_bias)
    beta = torch.rand(num_tokens, heads, device=device).sigmoid()
    return q, k, v, g, beta


def _recurrence(q, k, v, g, beta, initial: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """transformers' per-token recurrence on one sequence [tokens, heads, dim] -> (out, final state)."""
    out, state = torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], initial_state=None if initial is None else initial[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0], state[0]


def test_chunked_reference_matches_the_recurrence() -> None:
    """Three sequences across several chunks (1, 64 + 6, 2 * 64 + 3 tokens), one of them from a state."""
    lengths, heads, key_dim, value_dim = [1, 70, 131], 2, 16, 24
    q, k, v, g, beta = _inputs(sum(lengths), heads, key_dim, value_dim, torch.device("cpu"))
    state = torch.randn(5, heads, key_dim, value_dim)
    initial = state.clone()
    slots, has_initial = torch.tensor([3, 0, 4]), torch.tensor([False, True, False])
    starts = torch.tensor([0, 1, 71, 202], dtype=torch.int32)
    out = gated_delta_prefill_ref(q, k, v, g, beta, state, starts, slots, has_initial)
    for seq, (slot, init) in enumerate(zip(slots.tolist(), has_initial.tolist())):
        rows = slice(int(starts[seq]), int(starts[seq + 1]))
        expected_out, expected_state = _recurrence(q[rows], k[rows], v[rows], g[rows], beta[rows],
                                                   initial[slot] if init else None)
        torch.testing.assert_close(out[rows], expected_out, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(state[slot], expected_state, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(state[[1, 2]], initial[[1, 2]])  # slots nobody owns are untouched


def test_decode_reference_matches_the_recurrence() -> None:
    heads, key_dim, value_dim = 3, 16, 8
    q, k, v, g, beta = _inputs(2, heads, key_dim, value_dim, torch.device("cpu"))
    state = torch.randn(4, heads, key_dim, value_dim)
    initial = state.clone()
    out = gated_delta_decode_ref(q, k, v, g, beta, state, torch.tensor([2, 0]), torch.tensor([True, False]))
    for row, (slot, init) in enumerate([(2, True), (0, False)]):
        rows = slice(row, row + 1)
        expected_out, expected_state = _recurrence(q[rows], k[rows], v[rows], g[rows], beta[rows],
                                                   initial[slot] if init else None)
        torch.testing.assert_close(out[row], expected_out[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state[slot], expected_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("dtype", "key_dim", "value_dim"),
                         [(torch.float32, 16, 16), (torch.float32, 24, 20), (torch.float16, 16, 16)])
def test_prefill_kernel(device: torch.device, dtype: torch.dtype, key_dim: int, value_dim: int) -> None:
    """Sequences that end mid-chunk, span two chunks, and continue from their slot's state; 20 value columns are two
    blocks of the state (of 16, the second masked)."""
    lengths, heads = [5, 67, 1], 2
    q, k, v, g, beta = (t.to(dtype) for t in _inputs(sum(lengths), heads, key_dim, value_dim, device))
    state = torch.randn(4, heads, key_dim, value_dim, device=device)
    expected_state = state.clone()
    starts = torch.tensor([0, 5, 72, 73], dtype=torch.int32, device=device)
    slots = torch.tensor([1, 3, 0], dtype=torch.int32, device=device)
    has_initial = torch.tensor([True, False, True], device=device)
    out = gated_delta_prefill_triton(q, k, v, g, beta, state, starts, slots, has_initial)
    expected = gated_delta_prefill_ref(q, k, v, g, beta, expected_state, starts, slots, has_initial)
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    torch.testing.assert_close(state, expected_state, atol=1e-4, rtol=1e-4)


def test_decode_kernel(device: torch.device) -> None:
    heads, key_dim, value_dim = 4, 32, 40  # value columns in two blocks
    q, k, v, g, beta = _inputs(3, heads, key_dim, value_dim, device)
    state = torch.randn(5, heads, key_dim, value_dim, device=device)
    expected_state = state.clone()
    slots = torch.tensor([4, 0, 2], dtype=torch.int64, device=device)
    has_initial = torch.tensor([True, False, True], device=device)
    out = gated_delta_decode_triton(q, k, v, g, beta, state, slots, has_initial)
    expected = gated_delta_decode_ref(q, k, v, g, beta, expected_state, slots, has_initial)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, expected_state, atol=1e-5, rtol=1e-5)


def test_kernel_rejects_a_state_of_another_shape(device: torch.device) -> None:
    q, k, v, g, beta = _inputs(2, 2, 16, 16, device)
    with pytest.raises(ValueError, match="state"):
        gated_delta_decode_triton(q, k, v, g, beta, torch.zeros(2, 2, 16, 8, device=device),
                                  torch.tensor([0, 1], device=device), torch.tensor([False, False], device=device))
