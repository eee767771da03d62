"""The C++ CPU kernels (csrc/), compiled once per machine on first use and cached by torch.

Without a C++ compiler or ninja, `cpu_kernels()` returns None and the caller keeps its pure-torch
path; the reason is logged once.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "csrc" / "paged_decode.cpp"]
DISABLE_ENV = "KVFORGE_NO_CPU_EXTENSION"


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The compiled extension, or None when it cannot be built here (or KVFORGE_NO_CPU_EXTENSION=1)."""
    if os.environ.get(DISABLE_ENV) == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        logger.info("loading the CPU kernels (the first use on a machine compiles them, ~1 min)")
        return load(
            name="kvforge_cpu_kernels",
            sources=[str(s) for s in _SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp-simd"],
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError) as err:
        logger.warning("CPU kernels unavailable (%s); using the torch attention path", err)
        return None
