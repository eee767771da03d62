"""The planner's memory estimate against the engine: the default model loaded and run on the CPU (and on a
GPU, under the gpu marker). Measured: the bytes of the tensors the engine allocated, and the growth of the
process's resident memory from before the engine was built to the peak of a batched generation."""

from __future__ import annotations

import ctypes
import gc
import sys

import pytest
import torch

from kvforge.plan import PlanOptions, get_device, load_model_shape, make_plan, resolve_precision
from kvforge.sampling_params import SamplingParams

KV_CACHE_MEMORY = 256 * 2**20
NUM_SEQS = 8
PROMPT_LEN = 500
PROMPTS = [{"prompt_token_ids": list(range(100 + i, 100 + i + PROMPT_LEN))} for i in range(NUM_SEQS)]
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def default_shape():
    return load_model_shape(None)


def _plan_memory(shape, device_type: str, weight_dtype: str):
    device = get_device(device_type)
    options = PlanOptions(context_len=PROMPT_LEN + 16, max_num_seqs=NUM_SEQS, kv_cache_memory=KV_CACHE_MEMORY)
    plan = make_plan(shape, device, resolve_precision(weight_dtype, "auto", shape.checkpoint_format, device), options)
    (split,) = plan.splits
    return split.memory


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _resident_bytes(field: str) -> int:
    """VmRSS or VmHWM of this process, after freed heap memory went back to the system."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def test_default_model_parameter_count(default_shape):
    # SmolLM2-135M: 134,515,008 parameters with the embedding tied to the LM head (HF model card: 135M)
    assert default_shape.total_params == 134_515_008
    assert default_shape.num_layers == 30 and default_shape.tied_embeddings


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and calls glibc malloc_trim")
def test_cpu_memory_estimate_within_10_percent_of_measured(default_shape):
    from kvforge.kernels.cpu_extension import cpu_kernels
    from kvforge.llm import LLM

    estimate = _plan_memory(default_shape, "cpu", "auto")
    cpu_kernels()  # NOTE: the compiled kernels' code (and a first-use build) is no part of the model's memory
    baseline = _resident_bytes("VmRSS")
    llm = LLM(kv_cache_memory=KV_CACHE_MEMORY, device="cpu", max_num_seqs=NUM_SEQS)
    _resident_bytes("VmRSS")  # drop the loader's freed buffers before the peak is reset
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # reset VmHWM to the current resident size
    outputs = llm.generate(PROMPTS, PARAMS)
    peak_growth = _resident_bytes("VmHWM") - baseline

    assert [len(o.outputs[0].token_ids) for o in outputs] == [16] * NUM_SEQS
    runner = llm.engine.runner
    model_bytes = _tensor_bytes(runner.model.parameters()) + _tensor_bytes(runner.model.buffers())
    kv_bytes = _tensor_bytes(t for layer in runner.kv_caches for t in layer)
    # the tensors: weights and rotary tables exactly, the KV cache up to the engine's block rounding
    assert estimate.weights + estimate.buffers == pytest.approx(model_bytes, rel=1e-3)
    assert estimate.kv_cache == pytest.approx(kv_bytes, rel=0.01)
    # the process: tensors, activations and allocator overhead at the peak of a batched generation
    assert estimate.total == pytest.approx(peak_growth, rel=0.10), (
        f"estimated {estimate.total / 2**20:.0f} MiB, measured peak growth {peak_growth / 2**20:.0f} MiB"
    )


@pytest.mark.gpu
def test_gpu_memory_estimate_within_10_percent_of_measured(default_shape):
    from kvforge.llm import LLM

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA or ROCm device")
    estimate = _plan_memory(default_shape, "h100", "bf16")
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    llm = LLM(kv_cache_memory=KV_CACHE_MEMORY, device="cuda", dtype="bfloat16", max_num_seqs=NUM_SEQS)
    llm.generate(PROMPTS, PARAMS)
    peak_growth = torch.cuda.max_memory_allocated() - baseline
    assert estimate.total == pytest.approx(peak_growth, rel=0.10), (
        f"estimated {estimate.total / 2**20:.0f} MiB, measured peak {peak_growth / 2**20:.0f} MiB"
    )
