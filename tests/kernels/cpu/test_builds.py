"""Which build of the C++ kernels a CPU gets (kernels/cpu/builds.py), from the flags Linux reports for real CPUs, and
which builds setup.py makes (KVFORGE_CPU_VARIANTS)."""

from __future__ import annotations

import pytest

from kvforge.kernels.cpu import builds

# /proc/cpuinfo flags of real CPUs, cut to those that matter here.
_HASWELL = ("fpu sse sse2 pni ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt xsave avx f16c lahf_lm abm bmi1 avx2 bmi2 "
            "erms")
_SKYLAKE_X = _HASWELL + " avx512f avx512dq avx512cd avx512bw avx512vl"  # AVX-512 without VNNI
_ICELAKE_SERVER = _SKYLAKE_X + " avx512ifma avx512vbmi avx512_vbmi2 avx512_vnni avx512_bitalg"
_ZEN4 = _HASWELL + " avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512_bf16 avx512vbmi avx512_vnni"
_SANDY_BRIDGE = "fpu sse sse2 pni ssse3 cx16 sse4_1 sse4_2 popcnt xsave avx lahf_lm"
_GRAVITON3 = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm sve i8mm bf16"


@pytest.mark.parametrize("flags,machine,best", [
    (_ICELAKE_SERVER, "x86_64", "avx512-vnni"),
    (_ZEN4, "x86_64", "avx512-vnni"),
    (_SKYLAKE_X, "x86_64", "avx2"),
    (_HASWELL, "x86_64", "avx2"),
    (_HASWELL.replace(" f16c", ""), "x86_64", "portable"),  # an AVX2 build may use F16C: a CPU without it can't run it
    (_SANDY_BRIDGE, "x86_64", "portable"),
    (_GRAVITON3, "aarch64", "portable"),
    ("", "x86_64", "portable"),  # no /proc/cpuinfo
])  # fmt: skip
def test_each_cpu_gets_the_best_build_it_runs(flags: str, machine: str, best: str) -> None:
    variants = builds.runnable(frozenset(flags.split()), machine)
    assert variants[0].isa == best
    assert variants[-1].isa == "portable"


def test_x86_builds_never_run_on_another_architecture() -> None:
    """An aarch64 CPU reporting a flag of the same name (avx2 here, made up) still gets only the portable build."""
    assert [v.isa for v in builds.runnable(frozenset(_ICELAKE_SERVER.split()), "aarch64")] == ["portable"]


@pytest.mark.parametrize("requested,machine,flags,built", [
    ("", "x86_64", _HASWELL, ["avx512-vnni", "avx2", "portable"]),  # every variant, whatever the build machine runs
    ("", "aarch64", _GRAVITON3, ["portable"]),
    ("host", "x86_64", _ICELAKE_SERVER, ["avx512-vnni"]),
    ("host,portable", "x86_64", _HASWELL, ["avx2", "portable"]),
    ("host, portable", "aarch64", _GRAVITON3, ["portable"]),
    ("avx2,avx512-vnni,avx2", "x86_64", "", ["avx2", "avx512-vnni"]),
])  # fmt: skip
def test_the_builds_setup_makes(requested: str, machine: str, flags: str, built: list[str]) -> None:
    assert [v.isa for v in builds.variants_to_build(requested, machine, frozenset(flags.split()))] == built


@pytest.mark.parametrize("requested,machine", [("avx512", "x86_64"), ("avx2", "aarch64")])
def test_a_variant_setup_cannot_build_is_refused_by_name(requested: str, machine: str) -> None:
    with pytest.raises(ValueError, match=f"KVFORGE_CPU_VARIANTS: '{requested}' .* choose among .*host"):
        builds.variants_to_build(requested, machine, frozenset())


def test_module_names_tell_variants_and_sources_apart() -> None:
    names = {v.module_name(digest) for v in builds.VARIANTS for digest in ("sources-a", "sources-b")}
    assert len(names) == 2 * len(builds.VARIANTS)
    assert all(name.isidentifier() for name in names)


def test_the_loaded_ops_are_the_declared_ones() -> None:
    """Every op the loaded build registers under torch.ops.kvforge_cpu is declared in bindings.py, with the schema
    declared there (a kernel file registering an op of its own would be caught here), and the C entry points handed
    to Inductor are those of the declared ops."""
    import torch

    from kvforge.kernels.cpu import bindings
    from kvforge.kernels.cpu.extension import c_shims, cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("no build of the C++ kernels")
    registered = {name.partition("::")[2] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith(f"{bindings.NAMESPACE}::")}
    assert registered == {op.name for op in bindings.OPS}
    for op in bindings.OPS:
        schema = getattr(torch.ops.kvforge_cpu, op.name).default._schema
        assert schema == torch._C.parse_schema(f"{bindings.NAMESPACE}::{op.schema}"), op.name
    assert {shim.name for shim in c_shims()} == {"quant_gemm_panels", "paged_decode", "cache_write"}
