"""The causal depthwise conv1d with conv states: the reference against torch's conv1d run per sequence, and the Triton
kernel against the reference (in the interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvforge.kernels.causal_conv1d import causal_conv1d_ref, causal_conv1d_triton


def _conv1d(x: torch.Tensor, weight: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """torch's depthwise conv1d over one sequence [tokens, channels] after its history [width - 1, channels]."""
    inputs = torch.cat([history, x]).T[None]  # [1, channels, width - 1 + tokens]
    return F.silu(F.conv1d(inputs, weight[:, None], groups=weight.shape[0]))[0].T


def test_reference_matches_conv1d_across_a_prompt_and_decode_steps() -> None:
    """Three prompts (one shorter than the kernel, one continuing from its state), then two one-token steps each."""
    channels, width, lens = 6, 4, [2, 9, 5]
    weight = torch.randn(channels, width)
    conv_state = torch.randn(4, channels, width - 1)
    slots, has_initial = torch.tensor([2, 0, 3]), torch.tensor([False, False, True])
    history = [torch.zeros(width - 1, channels), torch.zeros(width - 1, channels), conv_state[3].T.clone()]
    untouched = conv_state[1].clone()
    x = torch.randn(sum(lens), channels)
    starts = torch.tensor([0, 2, 11, 16])
    out = causal_conv1d_ref(x, weight, None, conv_state, starts, slots, has_initial, silu=True)
    for seq in range(3):
        rows = x[int(starts[seq]) : int(starts[seq + 1])]
        torch.testing.assert_close(out[int(starts[seq]) : int(starts[seq + 1])], _conv1d(rows, weight, history[seq]))
        history[seq] = torch.cat([history[seq], rows])[-(width - 1) :]
        torch.testing.assert_close(conv_state[slots[seq]], history[seq].T)
    for _ in range(2):
        x = torch.randn(3, channels)
        out = causal_conv1d_ref(x, weight, None, conv_state, torch.arange(4), slots, torch.ones(3, dtype=torch.bool),
                                silu=True)
        for seq in range(3):
            torch.testing.assert_close(out[seq : seq + 1], _conv1d(x[seq : seq + 1], weight, history[seq]))
            history[seq] = torch.cat([history[seq], x[seq : seq + 1]])[1:]
            torch.testing.assert_close(conv_state[slots[seq]], history[seq].T)
    torch.testing.assert_close(conv_state[1], untouched)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("channels", "width", "lens"), [(8, 4, [1, 1, 1]), (200, 4, [2, 9, 1]), (5, 2, [3, 1])])
def test_kernel(device: torch.device, dtype: torch.dtype, channels: int, width: int, lens: list[int]) -> None:
    x = torch.randn(sum(lens), channels, device=device, dtype=dtype)
    weight = torch.randn(channels, width, device=device, dtype=dtype)
    bias = torch.randn(channels, device=device, dtype=dtype) if width == 4 else None
    conv_state = torch.randn(5, channels, width - 1, device=device, dtype=dtype)
    expected_state = conv_state.clone()
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    slots = torch.tensor([4, 1, 0][: len(lens)], dtype=torch.int32, device=device)
    has_initial = torch.tensor([True, False, True][: len(lens)], device=device)
    out = causal_conv1d_triton(x, weight, bias, conv_state, starts, slots, has_initial, silu=True)
    expected = causal_conv1d_ref(x, weight, bias, expected_state, starts, slots, has_initial, silu=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    torch.testing.assert_close(conv_state, expected_state, atol=tol, rtol=tol)


def test_kernel_rejects_a_state_of_another_width(device: torch.device) -> None:
    x = torch.randn(2, 4, device=device)
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_triton(x, torch.randn(4, 4, device=device), None, torch.zeros(2, 4, 2, device=device),
                             torch.tensor([0, 2], device=device), torch.tensor([0], device=device),
                             torch.tensor([False], device=device), silu=False)
