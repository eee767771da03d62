"""Device-only checks: compiled (not interpreted) kernels at model-sized shapes, and CUDA graph replay."""

from __future__ import annotations

import pytest
import torch

from kvforge.kernels.paged_attention import paged_attention_ref, paged_attention_triton
from tests.kernels.attention_batches import TOLERANCE, make_paged_batch, run_and_compare

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_model_sized_mixed_batch(dtype: torch.dtype, head_dim: int) -> None:
    """Llama-style heads (32 query, 8 KV): decodes over long contexts beside prefill chunks."""
    q_lens = [1, 1, 1, 1, 512, 1500, 37]
    seq_lens = [100, 4000, 17, 8000, 512, 3000, 2049]
    batch = make_paged_batch(
        q_lens,
        seq_lens,
        num_heads=32,
        num_kv_heads=8,
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        device="cuda",
    )
    run_and_compare(batch)


def test_cuda_graph_replay_follows_new_metadata() -> None:
    """Captured once, replayed after the batch's contexts grow and its query split changes."""
    batch = make_paged_batch(
        [1, 3, 3],
        [64, 320, 64],
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        block_size=16,
        dtype=torch.bfloat16,
        device="cuda",
    )
    batch.seq_lens.copy_(torch.tensor([40, 300, 60]))
    out = torch.empty_like(batch.query)
    paged_attention_triton(*batch.args(), 0.088, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention_triton(*batch.args(), 0.088, out=out)
    batch.seq_lens.copy_(torch.tensor([63, 317, 64]))
    batch.query_start_loc.copy_(torch.tensor([0, 1, 2, 7]))  # now: decode, decode, 5-token chunk
    graph.replay()
    expected = paged_attention_ref(*batch.args(), 0.088)
    tol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("code_dtype", [torch.int8, torch.float8_e4m3fn])
def test_model_sized_batch_over_quantized_cache(code_dtype: torch.dtype) -> None:
    """Compiled prefill and decode kernels reading int8 / fp8 codes and scales at Llama-sized heads."""
    from kvforge.kernels.kv_quant import check_triton_code_dtype
    from kvforge.platforms import current_platform
    from tests.kernels.attention_batches import dequantized_reference, quantize_batch_cache

    try:
        check_triton_code_dtype(code_dtype, current_platform())
    except ValueError as err:
        pytest.skip(str(err))
    batch = make_paged_batch([1, 1, 512, 1500, 37], [100, 8000, 512, 3000, 2049], num_heads=32, num_kv_heads=8,
                             head_dim=128, block_size=16, dtype=torch.bfloat16, device="cuda")
    batch, key_scale, value_scale = quantize_batch_cache(batch, code_dtype)
    expected = dequantized_reference(batch, key_scale, value_scale, 128**-0.5)
    out = paged_attention_triton(*batch.args(), 128**-0.5, key_scale, value_scale)
    tol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
