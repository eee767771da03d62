"""`kvforge compile-kernels` for every target, started at the beginning of the test session and read at the end.

The cold compile of every kernel case for the 8 targets takes ~290 core-seconds, which the suite's own tests leave
idle: most of them wait on Python, HTTP or child processes. So the two compile processes (NVIDIA and AMD side by
side) start when collection finishes, at the lowest CPU priority, and the cross-compile tests only wait for them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvforge.tools.compile_targets import TARGETS

NVIDIA = [arch for arch in TARGETS if arch.startswith("sm_")]
AMD = [arch for arch in TARGETS if arch.startswith("gfx")]


class CrossCompileRun:
    """The compile processes of one test session; results() waits for them once and keeps what they found."""

    def __init__(self) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="kvforge-cross-compile-")
        outs = {name: Path(self._folder.name) / f"{name}.json" for name in ("nvidia", "amd")}
        self._runs = [
            (self._start(archs, outs[name]), outs[name]) for name, archs in (("nvidia", NVIDIA), ("amd", AMD))
        ]
        self._results: list[dict] | None = None

    @staticmethod
    def _start(archs: list[str], out: Path) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "kvforge.cli", "compile-kernels", "--arch", *archs, "--json", str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
            preexec_fn=lambda: os.nice(19),
        )

    def results(self) -> list[dict]:
        if self._results is None:
            found = []
            for process, out in self._runs:
                log, _ = process.communicate(timeout=1800)
                assert out.exists(), log[-3000:]
                found += json.loads(out.read_text())
            self._results = found
            self._folder.cleanup()
        return self._results

    def stop(self) -> None:
        for process, _ in self._runs:
            if process.poll() is None:
                process.kill()
                process.communicate()
        self._folder.cleanup()


CROSS_COMPILE_RUN = pytest.StashKey[CrossCompileRun]()
