"""`kvforge env` as a user reads it, and what a user sees where the C++ kernels cannot be had: a warning that names
the cost, and `kvforge env` saying why."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

import kvforge
from kvforge.kernels.cpu.extension import kernels_build

ROWS = ("kvforge", "torch", "C++ kernels", "CPU ISA", "Triton", "devices", "threads")


def _env(cwd: Path | None = None, **variables: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVFORGE_")}
    return subprocess.run([sys.executable, "-m", "kvforge.cli", "env"], capture_output=True, text=True, timeout=900,
                          cwd=cwd, env={**environ, **variables})


def _rows(stdout: str) -> dict[str, str]:
    return {line[:12].strip(): line[13:] for line in stdout.splitlines()}


def test_env_tells_what_the_engine_uses() -> None:
    result = _env()
    assert result.returncode == 0, result.stderr
    rows = _rows(result.stdout)
    assert tuple(rows) == ROWS
    assert rows["kvforge"].startswith(kvforge.__version__)
    assert rows["torch"].startswith(torch.__version__)
    assert rows["C++ kernels"] == kernels_build().describe()  # the build this test process loaded, and its file
    # NOTE: a fresh process's count (this one's may have been changed by an earlier test)
    fresh = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert rows["threads"] == f"{fresh} (torch intra-op)"


def test_a_failed_build_is_loud_and_env_says_why(tmp_path: Path) -> None:
    """A checkout without built kernels (a copy of the package) and no C++ compiler: the first use's compile fails."""
    shutil.copytree(Path(kvforge.__file__).parent, tmp_path / "kvforge",
                    ignore=shutil.ignore_patterns("__pycache__", "_kernels_*"))
    result = _env(cwd=tmp_path, PYTHONPATH=str(tmp_path), CXX=str(tmp_path / "no-compiler"),
                  TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    assert result.returncode == 0, result.stderr
    assert "several times slower" in result.stderr
    assert _rows(result.stdout)["C++ kernels"].startswith(
        "not built (torch fallbacks): none came with kvforge, and compiling them failed")


def test_env_says_when_the_kernels_are_switched_off() -> None:
    result = _env(KVFORGE_NO_CPU_EXTENSION="1")
    assert _rows(result.stdout)["C++ kernels"] == "not built (torch fallbacks): KVFORGE_NO_CPU_EXTENSION=1"
