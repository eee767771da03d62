"""A model that cannot fit is refused before its load, with both figures and what to change."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kvforge.loader import memory_fit
from kvforge.loader.memory_fit import check_fits

CGROUP_V1 = Path("/sys/fs/cgroup/memory")


def test_check_fits_names_both_figures_and_what_to_change() -> None:
    check_fits("model.gguf", 2**30, 2**30, available=4 * 2**30)
    with pytest.raises(ValueError, match=r"model.gguf needs ~2\.5 GiB .* only 1\.0 GiB .*--kv-cache-memory"):
        check_fits("model.gguf", 2**30, 2**30, available=2**30)


def test_available_memory_is_at_most_what_the_system_has() -> None:
    with open("/proc/meminfo") as meminfo:
        total = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemTotal:"))
    assert 0 < memory_fit.available_memory() <= total


def test_engine_refuses_a_model_past_the_memory_left(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvforge import LLM

    monkeypatch.setattr(memory_fit, "available_memory", lambda: 700 * 2**20)
    with pytest.raises(ValueError, match=r"needs ~.* GiB .* only 0\.7 GiB of memory is available"):
        LLM(kv_cache_memory="256MiB")
    monkeypatch.undo()


@pytest.mark.skipif(not os.access(CGROUP_V1, os.W_OK), reason="needs a writable cgroup v1 memory hierarchy")
def test_cli_under_a_cgroup_limit_exits_2_with_one_line() -> None:
    """A real limit: `kvforge generate` in a memory cgroup of 1 GiB, asking for a 2 GiB KV cache."""
    group = CGROUP_V1 / f"kvforge-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(2**30))
        script = (f"import os, sys; open({str(group / 'cgroup.procs')!r}, 'w').write(str(os.getpid())); "
                  "from kvforge.cli import main; sys.exit(main(['generate', 'hi', '--kv-cache-memory', '2GiB']))")
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    finally:
        group.rmdir()
    assert done.returncode == 2, done.stderr[-2000:]
    assert "only" in done.stderr and "GiB of memory is available" in done.stderr
    assert "Traceback" not in done.stderr
