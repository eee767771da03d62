"""The C++ CPU kernels (csrc/), compiled once per machine on first use and cached by torch.

Without a C++ compiler or ninja, `cpu_kernels()` returns None and the caller keeps its pure-torch
path; the reason is logged once. paged_decode.cpp binds its functions on the returned module;
quant_gemv.cpp registers torch ops (`torch.ops.kvforge_cpu.*`), available once the module is loaded.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "csrc" / name for name in ("paged_decode.cpp", "quant_gemv.cpp")]
DISABLE_ENV = "KVFORGE_NO_CPU_EXTENSION"


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The compiled extension, or None when it cannot be built here (or KVFORGE_NO_CPU_EXTENSION=1)."""
    if os.environ.get(DISABLE_ENV) == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        logger.info("loading the CPU kernels (the first use on a machine compiles them, ~1 min)")
        # NOTE: a digest of the sources in the name: two checkouts with different kernels never share (and
        # rebuild over each other) one build folder, nor load each other's module.
        digest = hashlib.sha256(b"".join(s.read_bytes() for s in _SOURCES)).hexdigest()[:12]
        return load(
            name=f"kvforge_cpu_kernels_{digest}",
            sources=[str(s) for s in _SOURCES],
            # NOTE: -fopenmp, or at::parallel_for (inlined from torch's headers) runs on one thread. The
            # module then needs libgomp.so.1, which resolves to the copy torch has already loaded.
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError) as err:
        logger.warning("CPU kernels unavailable (%s); using the torch attention and quantized-matmul paths", err)
        return None
