"""kvforge.kernels.ops: backend selection, custom-op registration, fake implementations, tracing."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

import pytest
import torch

from kvforge.kernels import ops
from kvforge.kernels.cpu.extension import cpu_kernels
from kvforge.kernels.cpu.layer_ops import rms_norm_cpu
from kvforge.kernels.cpu.paged_attention import paged_attention_cpu
from kvforge.kernels.rms_norm import rms_norm_ref
from kvforge.platforms import backend as backend_module
from kvforge.platforms import current_platform
from tests.kernels.attention_batches import make_paged_batch


def test_cpu_default_binds_the_torch_paths_directly() -> None:
    if torch.cuda.is_available():
        pytest.skip("the default is triton on a GPU")
    table = ops.op_table()
    assert table.backend == "torch"
    # the C++ norm where the CPU kernels build (it runs the reference under tracing), else the reference itself
    assert table.rms_norm is (rms_norm_cpu if cpu_kernels() is not None else rms_norm_ref)
    assert table.paged_attention is paged_attention_cpu


def test_op_table_per_backend(device: torch.device) -> None:
    triton_ops, torch_ops = ops.op_table("triton"), ops.op_table("torch")
    # bound to the platform they were made for (the current one here): its launches read that one's tiles
    assert triton_ops.platform == current_platform() == torch_ops.platform
    assert triton_ops.paged_attention.func is torch.ops.kvforge.paged_attention
    assert triton_ops.paged_attention.keywords == {"platform": current_platform().launch_key}
    assert torch_ops.rms_norm in (rms_norm_ref, rms_norm_cpu)
    x = torch.randn(3, 64, device=device)
    weight = torch.randn(64, device=device)
    torch.testing.assert_close(triton_ops.rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))


def test_every_op_that_takes_a_platform_is_bound_to_the_tables() -> None:
    """An engine's Triton table calls each custom op whose schema takes a platform with its platform's launch key, so
    that no launch falls back to the process's platform."""
    table = ops.op_table("triton")
    for field in dataclasses.fields(ops.OpTable):
        op = getattr(ops.TRITON_OPS, field.name)
        if isinstance(op, torch._ops.OpOverloadPacket):  # a custom op, or a function in front of one
            takes_platform = any(arg.name == "platform" for arg in op.default._schema.arguments)
        elif callable(op):
            takes_platform = "platform" in inspect.signature(op).parameters
        else:
            continue
        bound = getattr(table, field.name)
        assert getattr(bound, "keywords", {}).get("platform") == (
            current_platform().launch_key if takes_platform else None), field.name


def test_layers_capture_the_table_they_are_built_with() -> None:
    from kvforge.layers.norm import RMSNorm

    with ops.building_with_ops(ops.op_table("triton")):
        triton_norm = RMSNorm(8, 1e-6)
    assert triton_norm.ops.backend == "triton"
    assert RMSNorm(8, 1e-6).ops is ops.current_ops() and ops.current_ops().backend == "torch"


def test_op_table_rejects_unknown_and_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="'cuda'"):
        ops.op_table("cuda")
    monkeypatch.setattr(backend_module, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="not installed"):
        ops.op_table("triton")


def _op_samples(device: torch.device) -> list[tuple[object, tuple]]:
    x = torch.randn(3, 32, device=device)
    weight = torch.randn(32, device=device)
    qkv = torch.randn(3, (4 + 2 + 2) * 32, device=device)  # query and key as the model gets them: views
    query, key = qkv[:, : 4 * 32].view(3, 4, 32), qkv[:, 4 * 32 : 6 * 32].view(3, 2, 32)
    positions = torch.tensor([0, 5, 9], device=device)
    cos_sin = torch.randn(16, 32, device=device)
    cache = torch.zeros(4, 16, 2, 32, device=device)
    slots = torch.tensor([0, 17, 40], device=device)
    batch = make_paged_batch(
        [1, 2],
        [5, 2],
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        dtype=torch.float32,
        device=device,
    )
    kvforge = torch.ops.kvforge
    return [
        (kvforge.rms_norm, (x, weight, 1e-6)),
        (kvforge.fused_add_rms_norm, (x, x.clone(), weight, 1e-6)),
        (kvforge.rotary_embedding, (positions, query, key, cos_sin, True)),
        (kvforge.silu_and_mul, (x,)),
        (kvforge.reshape_and_cache, (key, key.clone(), cache, cache.clone(), slots)),
        (kvforge.paged_attention, (*batch.args(), 0.2)),
        (kvforge.paged_attention, (qkv[:, : 4 * 32].view(3, 4, 32), *batch.args()[1:], 0.2)),
        *_linear_attention_samples(device),
    ]


def _linear_attention_samples(device: torch.device) -> list[tuple[object, tuple]]:
    """Two sequences (2 tokens and 1) of 2 heads on state slots 1 and 0; the second continues from its state."""
    q, k, v = (torch.randn(3, 2, 16, device=device) for _ in range(3))
    g, beta = -torch.rand(3, 2, device=device), torch.rand(3, 2, device=device)
    state, conv_state = torch.randn(2, 2, 16, 16, device=device), torch.randn(2, 8, 3, device=device)
    starts = torch.tensor([0, 2, 3], dtype=torch.int32, device=device)
    slots, initial = torch.tensor([1, 0], dtype=torch.int32, device=device), torch.tensor([False, True], device=device)
    kvforge = torch.ops.kvforge
    return [
        (kvforge.gated_delta_prefill, (q, k, v, g, beta, state, starts, slots, initial)),
        (kvforge.gated_delta_decode, (q[:2], k[:2], v[:2], g[:2], beta[:2], state, slots, initial)),
        (kvforge.causal_conv1d, (torch.randn(3, 8, device=device), torch.randn(8, 4, device=device), None,
                                 conv_state, starts, slots, initial, True)),
    ]


def test_custom_ops_pass_opcheck(device: torch.device) -> None:
    """Schemas (incl. mutates_args) and fake implementations agree with what the kernels do."""
    for op, args in _op_samples(device):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_ops_trace_into_one_graph(device: torch.device) -> None:
    table = ops.op_table("triton")

    def block(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        normed, residual = table.fused_add_rms_norm(x, residual, weight, 1e-6)
        return table.silu_and_mul(normed) + residual[:, :16]

    x, residual, weight = torch.randn(4, 32, device=device), torch.randn(4, 32, device=device), torch.ones(32)
    weight = weight.to(device)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, residual, weight), block(x, residual, weight))


_WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # import triton now raises ImportError
import torch
from kvforge.kernels import ops
from kvforge.kernels.rms_norm import rms_norm_triton
x, weight = torch.randn(2, 8), torch.ones(8)
assert ops.op_table(None).backend == "torch" and ops.op_table(None).rms_norm(x, weight, 1e-6).shape == (2, 8)
for call in (lambda: ops.op_table("triton"), lambda: rms_norm_triton(x, weight, 1e-6)):
    try:
        call()
    except ValueError as error:
        assert "triton" in str(error)
    else:
        raise AssertionError("no ValueError")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback")
def test_references_work_without_triton() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TRITON], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
