"""Builds kvforge with its C++ CPU kernels compiled: one extension module per instruction-set variant
(kvforge/kernels/cpu/builds.py), so that the engine's first use compiles nothing.

An extension runs only with the torch it was compiled against, so the package requires exactly that torch version.
Build against the torch you run (the CPU build, installed first) without pip's build isolation, which would fetch
another torch (on Linux, the multi-GB CUDA build):

    pip install torch==2.13.0
    pip wheel --no-build-isolation --no-deps -w dist .            # all variants (x86-64: 3; elsewhere: portable)
    KVFORGE_CPU_VARIANTS=host pip install --no-build-isolation -e .   # only the variant this CPU runs

Everything else about the package is in pyproject.toml.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from pathlib import Path

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).parent
CPU_PACKAGE = "kvforge.kernels.cpu"


def _builds_module():
    """kvforge/kernels/cpu/builds.py, read by its path: importing kvforge would import the whole engine."""
    spec = importlib.util.spec_from_file_location("kvforge_cpu_builds", ROOT / "kvforge/kernels/cpu/builds.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # NOTE: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class BuildVariants(BuildExtension):
    """torch's build, with each variant's object files in a folder of their own under build/kernels (the variants
    compile the same sources, whose objects would overwrite each other's), kept there so that a build of unchanged
    sources (scripts/setup.sh's, each run) compiles nothing again; and without the modules of earlier builds (other
    sources, other variants), which setuptools would otherwise leave in build/ and in the wheel."""

    def run(self) -> None:
        made = {ext.name.rpartition(".")[2] for ext in self.extensions}
        folders = [Path(self.build_lib, *CPU_PACKAGE.split("."))] + ([ROOT.joinpath(*CPU_PACKAGE.split("."))]
                                                                      if self.inplace else [])
        for stale in (f for folder in folders for f in folder.glob("_kernels_*") if f.name.split(".")[0] not in made):
            stale.unlink()
        super().run()

    def build_extension(self, ext) -> None:
        base = self.build_temp
        variant = ext.name.rpartition(".")[2].rpartition("_")[0]  # _kernels_<isa>, without the digest
        self.build_temp = str(ROOT / "build" / "kernels" / variant)
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = base


def _extensions() -> list[CppExtension]:
    builds = _builds_module()
    variants = builds.variants_to_build(os.environ.get(builds.BUILD_VARIANTS_ENV, ""), platform.machine(),
                                        builds.cpu_flags())
    digest = builds.sources_digest()
    generated = builds.write_generated(ROOT / "build" / "kernels" / "generated")  # the ops' bindings (builds.py)
    sources = [str(path.relative_to(ROOT)) for path in builds.sources(generated)]
    headers = [str(path.relative_to(ROOT)) for path in [*sorted(builds.CSRC.glob("*.h")), generated / "ops.h"]]
    return [CppExtension(f"{CPU_PACKAGE}.{variant.module_name(digest)}", sources, depends=headers,
                         include_dirs=[str(generated)],  # NOTE: absolute: ninja compiles in build_temp
                         extra_compile_args=[*builds.COMMON_FLAGS, *variant.march_flags],
                         extra_link_args=list(builds.LINK_FLAGS))
            for variant in variants]


TORCH_REQUIREMENT = f"torch=={torch.__version__.split('+')[0]}"  # the build's torch, local label (+cpu) aside

setup(
    ext_modules=_extensions(),
    cmdclass={"build_ext": BuildVariants},
    install_requires=[
        TORCH_REQUIREMENT,
        "numpy",
        "safetensors",
        "tokenizers>=0.19",
        "gguf>=0.10",
        "jinja2",
        "tqdm",
        "fastapi",
        "uvicorn",
        "prometheus-client",
        "httpx",
        "ninja",  # the fallback build on first use, where no built variant runs (kernels/cpu/extension.py)
        "llguidance==1.9.1",
    ],
)
