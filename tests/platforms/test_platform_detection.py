"""Platform detection on this machine and on faked CUDA / ROCm devices, backend choice, tuning lookup."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from kvforge.kernels.tuning import ARCH_TUNING, DEFAULT_TUNING, DecodeTiles, kernel_tuning
from kvforge.platforms import (
    DevicePeak,
    Platform,
    current_platform,
    detect_platform,
    lookup_device_peak,
    select_backend,
)
from kvforge.platforms import backend as backend_module

GIB = 1 << 30


def fake_gpu(
    monkeypatch: pytest.MonkeyPatch,
    *,
    name: str,
    hip: str | None,
    props: SimpleNamespace,
    capability: tuple[int, int] = (0, 0),
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine")
def test_detects_this_cpu_machine() -> None:
    platform = current_platform()
    assert platform.kind == "cpu" and not platform.is_gpu and platform.device_type == "cpu"
    assert platform.warp_size == 1 and platform.num_compute_units >= 1
    assert platform.total_memory_bytes > 0 and platform.peak is None
    assert current_platform() is platform  # detected once


def test_fake_rocm_mi300x(monkeypatch: pytest.MonkeyPatch) -> None:
    props = SimpleNamespace(
        gcnArchName="gfx942:sramecc+:xnack-", warp_size=64, multi_processor_count=304, total_memory=192 * GIB
    )
    fake_gpu(monkeypatch, name="AMD Instinct MI300X", hip="6.2.41133", props=props)
    monkeypatch.setattr(backend_module, "triton_available", lambda: True)
    platform = detect_platform()
    assert (platform.kind, platform.arch, platform.warp_size) == ("rocm", "gfx942", 64)
    assert platform.device_type == "cuda" and platform.num_compute_units == 304
    assert platform.peak == lookup_device_peak("MI300X") and platform.peak.memory_bandwidth_gbs == 5300.0
    assert kernel_tuning(platform) is ARCH_TUNING["gfx942"]
    assert select_backend(None, platform) == "triton"


@pytest.mark.parametrize(("arch", "warp_size"), [("gfx90a", 64), ("gfx1100", 32)])
def test_rocm_wavefront_without_warp_size_property(
    monkeypatch: pytest.MonkeyPatch, arch: str, warp_size: int
) -> None:
    """CDNA (gfx9) runs 64-wide wavefronts, RDNA 32-wide, when torch does not report warp_size."""
    props = SimpleNamespace(gcnArchName=arch, multi_processor_count=104, total_memory=64 * GIB)
    fake_gpu(monkeypatch, name="AMD Radeon", hip="6.0", props=props)
    assert detect_platform().warp_size == warp_size


def test_fake_cuda_h200(monkeypatch: pytest.MonkeyPatch) -> None:
    props = SimpleNamespace(warp_size=32, multi_processor_count=132, total_memory=141 * GIB)
    fake_gpu(monkeypatch, name="NVIDIA H200", hip=None, props=props, capability=(9, 0))
    platform = detect_platform()
    assert (platform.kind, platform.arch, platform.warp_size) == ("cuda", "sm_90", 32)
    assert platform.peak == DevicePeak(4800.0, 989.0, 67.0)
    assert kernel_tuning(platform) is ARCH_TUNING["sm_90"]


def test_unknown_arch_gets_default_tuning(monkeypatch: pytest.MonkeyPatch) -> None:
    props = SimpleNamespace(warp_size=32, multi_processor_count=40, total_memory=16 * GIB)
    fake_gpu(monkeypatch, name="Tesla T4", hip=None, props=props, capability=(7, 5))
    platform = detect_platform()
    assert platform.arch == "sm_75" and platform.peak is None
    assert kernel_tuning(platform) is DEFAULT_TUNING


@pytest.mark.parametrize(
    ("name", "bandwidth"),
    [
        ("NVIDIA A100-SXM4-80GB", 2039.0),
        ("NVIDIA A100-SXM4-40GB", 1555.0),
        ("NVIDIA H100 PCIe", 2000.0),
        ("NVIDIA H100 80GB HBM3", 3350.0),
        ("AMD Instinct MI250X/MI250", 3277.0),
        ("NVIDIA L40", 864.0),
        ("NVIDIA L4", 300.0),
    ],
)
def test_device_peak_lookup_prefers_specific_names(name: str, bandwidth: float) -> None:
    assert lookup_device_peak(name).memory_bandwidth_gbs == bandwidth


def test_unknown_device_has_no_peak() -> None:
    assert lookup_device_peak("Some Future GPU") is None


def _cpu() -> Platform:
    return Platform("cpu", "cpu", "x86_64", 1, 4, GIB, None)


def test_backend_auto_falls_back_to_torch_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    backend_module._log_fallback_once.cache_clear()
    with caplog.at_level(logging.INFO, logger=backend_module.__name__):
        assert select_backend(None, _cpu()) == "torch"
        assert select_backend("auto", _cpu()) == "torch"
    assert len(caplog.records) == 1 and "no CUDA or ROCm device" in caplog.text


def test_backend_auto_without_triton_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = Platform("cuda", "NVIDIA H200", "sm_90", 32, 132, 141 * GIB, None)
    monkeypatch.setattr(backend_module, "triton_available", lambda: False)
    assert select_backend(None, gpu) == "torch"
    with pytest.raises(ValueError, match="not installed"):
        select_backend("triton", gpu)


def test_backend_forced_and_invalid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend_module, "triton_available", lambda: True)
    assert select_backend("triton", _cpu()) == "triton"  # the interpreter, for tests
    assert select_backend("torch", _cpu()) == "torch"
    with pytest.raises(ValueError, match="'flash'"):
        select_backend("flash", _cpu())


def test_platform_and_tuning_validation() -> None:
    with pytest.raises(ValueError, match="kind"):
        Platform("tpu", "x", "x", 1, 1, 0, None)
    with pytest.raises(ValueError, match="bf16_tflops"):
        DevicePeak(100.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="power of two"):
        DecodeTiles(block_n=48, num_warps=4, num_stages=1, programs_per_unit=2, max_splits=8)


def test_decode_splits_fill_the_device_at_small_batch() -> None:
    """H200: 132 SMs, 2 programs per SM wanted."""
    tiles = ARCH_TUNING["sm_90"].decode
    assert tiles.num_splits(num_seqs=1, num_kv_heads=8, num_compute_units=132) == 32  # capped
    assert tiles.num_splits(num_seqs=8, num_kv_heads=8, num_compute_units=132) == 4  # 5, to a power of 2
    assert tiles.num_splits(num_seqs=256, num_kv_heads=8, num_compute_units=132) == 1
