"""A step that runs a torch.compile graph has none of our ranges inside it (dynamo drops them): its matmuls
count as gemm.compiled and the rest of Inductor's code as fused, and the step that compiled is marked."""

from __future__ import annotations

import torch
from torch.profiler import profile

from kvforge.profiler.op_classes import MODEL, STEP
from kvforge.profiler.ranges import span
from kvforge.profiler.report import coverage
from kvforge.profiler.timeline import step_profiles
from kvforge.profiler.work import Inventory


def test_a_compiled_step_is_split_by_kernel_names() -> None:
    linear = torch.nn.Linear(1024, 1024)  # NOTE: large enough that the kernels dominate the call overhead

    def forward(x: torch.Tensor) -> torch.Tensor:
        with span("gemm.qkv"):  # inside the graph: dynamo drops it
            return torch.relu(linear(x)) * 2 + 1

    step = torch.compile(forward, fullgraph=True, dynamic=False)
    x = torch.randn(64, 1024)
    with torch.inference_mode(), profile() as prof:
        for _ in range(4):
            with span(STEP), span(MODEL), span("fused"):  # as the runner wraps its compiled decode step
                step(x)
    first, *steps = step_profiles(prof.events(), [], Inventory(act_bytes=4, hidden=1024))
    assert first.compiling and not any(s.compiling for s in steps)
    for s in steps:
        assert s.compiled and s.seconds["gemm.compiled"] > 0 and s.seconds["fused"] > 0
        assert "gemm.qkv" not in s.seconds
    model_share, _ = coverage(steps)
    assert model_share > 0.9
