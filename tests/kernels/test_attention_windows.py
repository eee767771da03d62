"""Sliding windows, logit soft-capping and attention sinks in every paged attention path: the torch reference against
a per-query oracle, and the Triton kernels (interpreter) and the CPU kernels against the reference, with windows that
end mid-block, sinks that dominate the softmax, and the blocks a window has left replaced by poisoned null blocks (as
the KV cache manager gives them back)."""

from __future__ import annotations

import pytest
import torch

from kvforge.kernels.cpu.paged_attention import paged_attention_cpu
from kvforge.kernels.paged_attention import attention_options, paged_attention_ref, paged_attention_triton
from tests.kernels.attention_batches import TOLERANCE, make_paged_batch


def _oracle(batch, scale: float, window: int, softcap: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """One query at a time in float64: scores of the keys the query sees, capped, a sink logit, softmax."""
    out = torch.empty(batch.query.shape, dtype=torch.float64)
    group = batch.query.shape[1] // batch.key_cache.shape[2]
    starts = batch.query_start_loc.tolist()
    for seq, seq_len in enumerate(batch.seq_lens.tolist()):
        keys, values = (t.double() for t in batch.contiguous_kv(seq))
        q_len = starts[seq + 1] - starts[seq]
        for i in range(q_len):
            pos = seq_len - q_len + i
            first = max(0, pos - window + 1) if window else 0
            for head in range(batch.query.shape[1]):
                q = batch.query[starts[seq] + i, head].double()
                scores = keys[first : pos + 1, head // group] @ q * scale
                if softcap:
                    scores = softcap * torch.tanh(scores / softcap)
                logits = scores if sinks is None else torch.cat([scores, sinks[head : head + 1].double()])
                probs = torch.softmax(logits, 0)[: len(scores)]
                out[starts[seq] + i, head] = probs @ values[first : pos + 1, head // group]
    return out


def _forget_left_blocks(batch, window: int, poison: float = float("nan")) -> None:
    """What the cache manager does: every block wholly before each sequence's earliest query's window goes to the
    null block, which holds `poison` (as does every slot outside the contexts)."""
    block_size = batch.key_cache.shape[1]
    starts = batch.query_start_loc.tolist()
    for seq, seq_len in enumerate(batch.seq_lens.tolist()):
        first_query = seq_len - (starts[seq + 1] - starts[seq])
        num_left = max(0, first_query - window + 1) // block_size
        batch.block_tables[seq, :num_left] = 0
    used = batch.used_slots()
    for cache in (batch.key_cache, batch.value_cache):
        cache[~used] = poison
        cache[0] = poison


CASES = [  # q_lens, seq_lens, window, block_size: decodes and prefill chunks, windows ending mid-block
    ([1, 1, 1], [5, 37, 64], 6, 4),
    ([7, 1, 20], [30, 19, 20], 5, 4),
    ([13, 3], [50, 3], 16, 16),
    ([9], [40], 11, 8),
]


@pytest.mark.parametrize(("q_lens", "seq_lens", "window", "block_size"), CASES)
@pytest.mark.parametrize(("softcap", "sink_scale"), [(0.0, 0.0), (0.0, 40.0), (2.0, 1.0)])
def test_reference_matches_a_per_query_oracle(q_lens, seq_lens, window, block_size, softcap, sink_scale):
    torch.manual_seed(0)
    batch = make_paged_batch(q_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=8, block_size=block_size,
                             dtype=torch.float32)
    sinks = torch.randn(4) * sink_scale if sink_scale else None
    expected = _oracle(batch, 0.35, window, softcap, sinks)
    out = paged_attention_ref(*batch.args(), 0.35, None, None, window, softcap, sinks)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    if sink_scale == 40.0:  # heads whose sink dominates give (almost) nothing back
        assert out[:, sinks > 30].abs().max() < 1e-6 if (sinks > 30).any() else True


def _sinks(num_heads: int) -> torch.Tensor:
    """Sinks of every size: half the heads' dominate their softmax (e^25 against scores near 1)."""
    return torch.tensor([25.0 if h % 2 else -1.5 + h * 0.3 for h in range(num_heads)])


@pytest.mark.parametrize(("q_lens", "seq_lens", "window", "block_size"), CASES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_kernels_read_only_the_window(q_lens, seq_lens, window, block_size, num_splits):
    torch.manual_seed(1)
    batch = make_paged_batch(q_lens, seq_lens, num_heads=6, num_kv_heads=2, head_dim=16, block_size=block_size,
                             dtype=torch.float32)
    sinks = _sinks(6)
    for softcap, head_sinks in [(0.0, sinks), (3.0, None)]:
        expected = paged_attention_ref(*batch.args(), 0.25, None, None, window, softcap, head_sinks)
        forgetful = type(batch)(*(t.clone() for t in batch.args()))
        _forget_left_blocks(forgetful, window)
        out = torch.full_like(batch.query, float("nan"))
        paged_attention_triton(*forgetful.args(), 0.25, None, None, window, softcap, head_sinks, out=out,
                               num_splits=num_splits)
        tol = TOLERANCE[torch.float32]
        torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


def test_triton_kernels_in_half_precision_with_every_option():
    torch.manual_seed(2)
    batch = make_paged_batch([1, 12, 1], [70, 12, 9], num_heads=8, num_kv_heads=1, head_dim=32, block_size=16,
                             dtype=torch.float16)
    expected = paged_attention_ref(*batch.args(), 0.2, None, None, 24, 4.0, _sinks(8))
    out = paged_attention_triton(*batch.args(), 0.2, None, None, 24, 4.0, _sinks(8), num_splits=2)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("native", [True, False], ids=["cpp", "torch"])
@pytest.mark.parametrize(("q_lens", "seq_lens", "window", "block_size"), CASES)
def test_cpu_kernels_read_only_the_window(q_lens, seq_lens, window, block_size, native, monkeypatch):
    if not native:
        import kvforge.kernels.cpu.paged_attention as module

        monkeypatch.setattr(module, "cpu_kernels", lambda: None)
    torch.manual_seed(3)
    batch = make_paged_batch(q_lens, seq_lens, num_heads=6, num_kv_heads=3, head_dim=20, block_size=block_size,
                             dtype=torch.float32)
    sinks = _sinks(6)
    for softcap, head_sinks in [(0.0, sinks), (2.5, None), (1.5, sinks)]:
        expected = paged_attention_ref(*batch.args(), 0.3, None, None, window, softcap, head_sinks)
        forgetful = type(batch)(*(t.clone() for t in batch.args()))
        # NOTE: the torch path gathers whole blocks and masks what a window leaves out: stale rows must be finite
        # (as a reused block's or the zeroed null block's are), where the C++ kernels never read them at all
        _forget_left_blocks(forgetful, window, float("nan") if native else 1e4)
        out = paged_attention_cpu(*forgetful.args(), 0.3, None, None, window, softcap, head_sinks)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_bad_options_are_refused():
    query = torch.zeros(3, 4, 8)
    with pytest.raises(ValueError, match="sliding_window"):
        attention_options(query, -1, 0.0, None)
    with pytest.raises(ValueError, match="softcap"):
        attention_options(query, 0, float("inf"), None)
    with pytest.raises(ValueError, match="sinks"):
        attention_options(query, 0, 0.0, torch.zeros(3))
