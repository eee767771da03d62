"""The choice of kernel backend: Triton kernels on GPUs, the torch reference path elsewhere."""

from __future__ import annotations

import functools
import importlib.util
import logging

from kvforge.platforms.detect import Platform, current_platform

KERNEL_BACKENDS = ("torch", "triton")

logger = logging.getLogger(__name__)


@functools.cache
def triton_available() -> bool:
    """Whether triton is installed. NOTE: found, not imported: importing it is the kernels' business,
    which on a machine without a GPU must select the interpreter first."""
    try:
        return importlib.util.find_spec("triton") is not None
    except ValueError:  # present in sys.modules as None: blocked
        return False


@functools.cache
def _log_fallback_once(reason: str) -> None:
    logger.info("kernels use the torch reference path: %s", reason)


def select_backend(requested: str | None = None, platform: Platform | None = None) -> str:
    """Resolve a requested backend ("torch", "triton", or None/"auto") to the one the ops will use.

    Auto picks "triton" on CUDA and ROCm when triton is installed, "torch" otherwise (logged once).
    "triton" on the CPU means interpreted Triton, which is only good for testing the kernels."""
    if requested is None or requested == "auto":
        platform = platform if platform is not None else current_platform()
        if platform.is_gpu and triton_available():
            return "triton"
        _log_fallback_once("triton is not installed" if platform.is_gpu else "no CUDA or ROCm device")
        return "torch"
    if requested not in KERNEL_BACKENDS:
        raise ValueError(f"kernel backend must be one of {KERNEL_BACKENDS} or 'auto', got {requested!r}")
    if requested == "triton" and not triton_available():
        raise ValueError("kernel backend 'triton' requested but triton is not installed (pip install triton)")
    return requested
