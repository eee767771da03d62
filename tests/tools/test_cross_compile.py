"""Every Triton kernel compiles, as the engine launches it, for each GPU architecture kvforge tunes for:
within the device's shared memory (Triton's own load-time check) and without spilling registers.

No GPU is needed: `kvforge compile-kernels` compiles for named targets (NVIDIA PTX + ptxas, AMD GCN)
in processes of their own. The interpreter, which runs every other kernel test, accepts code that no
GPU compiler does (a plain-float global inside a kernel was one), so this is the only check of the
kernels as a GPU build sees them until a device runs them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvforge.tools.cross_compile import TARGETS, cases
from tests.tools.cross_compile_run import CROSS_COMPILE_RUN, CrossCompileRun

pytest.importorskip("triton")

FP8_KV_CASES = {"attention hd128 fp8 KV", "cache write fp8 KV"}
NO_FP8_KV = {"sm_80", "gfx90a", "gfx1100"}  # no fp8 e4m3 (fn, or fnuz on gfx942) there
# Known and documented in the tuning table: MLA's 16-head x 512 latent accumulator on 32-wide RDNA3 waves.
KNOWN_SPILLS = {("gfx1100", "mla decode 1 seqs"), ("gfx1100", "mla decode 64 seqs")}
# Known and documented in kernels/gated_delta_rule.py: the delta rule's row-by-row triangular solve, everywhere.
KNOWN_SPILLS |= {(arch, "gated delta prefill + conv1d") for arch in TARGETS}
# KNOWN REGRESSIONS, to tune: the prefill tile's sliding-window and sink arguments cost sm_80 8-16 bytes a thread and
# RDNA3's int8-KV tile 340; the MXFP4 grouped GEMM's one-token tile spills 40-48 bytes on sm_100
KNOWN_SPILLS |= {("sm_80", case) for case in ("attention hd80 bfloat16", "attention hd128 bfloat16",
                                              "attention hd128 float16", "attention hd128 int8 KV")}
KNOWN_SPILLS |= {("gfx1100", "attention hd128 int8 KV"), ("sm_100", "mxfp4 moe 1 tokens")}


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest) -> list[dict]:
    """Every case for every target, from the compile processes that tests/conftest.py started with the session
    (or started here, when the session did not)."""
    run = request.config.stash.get(CROSS_COMPILE_RUN, None)
    if run is None:
        run = CrossCompileRun()
        request.addfinalizer(run.stop)
    return run.results()


def test_every_case_compiles_for_every_target(results: list[dict]) -> None:
    failed = [f"{r['arch']} {r['case']}: {r['error']}" for r in results if r["type"] == "Failure" and not r["refused"]]
    assert not failed, "\n".join(failed)
    done = {(r["arch"], r["case"]) for r in results}
    assert done == {(arch, case) for arch in TARGETS for case in cases()}


def test_fp8_kv_is_refused_exactly_where_fp8_is_not_native(results: list[dict]) -> None:
    refused = {(r["arch"], r["case"]) for r in results if r["type"] == "Failure" and r["refused"]}
    assert refused == {(arch, case) for arch in NO_FP8_KV for case in FP8_KV_CASES}
    assert all("--kv-cache-dtype int8" in r["error"] for r in results if r["type"] == "Failure")


def test_no_kernel_spills_registers_or_overflows_shared_memory(results: list[dict]) -> None:
    compiled = [r for r in results if r["type"] == "Compiled"]
    kernels = {r["kernel"] for r in compiled}
    assert {"_prefill_kernel", "_decode_kernel", "_reduce_kernel", "_quant_gemm_kernel", "_int8_gemm_kernel",
            "_grouped_gemm_kernel", "_mla_decode_kernel", "_rms_norm_kernel", "_rotary_kernel",
            "_silu_and_mul_kernel", "_reshape_and_cache_kernel"} <= kernels  # fmt: skip
    spilled = [r for r in compiled if r["spill_bytes"] and (r["arch"], r["case"]) not in KNOWN_SPILLS]
    assert not spilled, "\n".join(f"{r['arch']} {r['case']} {r['kernel']}: {r['spill_bytes']} B" for r in spilled)
    assert {(r["arch"], r["case"]) for r in compiled if r["spill_bytes"]} == KNOWN_SPILLS
    over = [r for r in compiled if r["shared_bytes"] > TARGETS[r["arch"]].shared_memory_bytes]
    assert not over
    assert all(0 < r["registers"] <= 512 for r in compiled)
    big = max(r["shared_bytes"] for r in compiled if r["arch"] == "sm_90" and r["kernel"] == "_prefill_kernel")
    assert big > 64 * 1024  # the H100/H200 tiles do use the large shared memory


def test_a_tile_too_big_for_the_device_is_reported(tmp_path: Path) -> None:
    """The MI300X's 64 KiB LDS against MLA's 576-wide latent rows at 64 keys per step: what the tuning
    table's latent_block_n=32 avoids."""
    script = (
        "import dataclasses, sys\n"
        "from kvforge.kernels import tuning\n"
        "from kvforge.tools import cross_compile as cc\n"
        "t = tuning.ARCH_TUNING['gfx942']\n"
        "decode = dataclasses.replace(t.decode, latent_block_n=64)\n"
        "tuning.ARCH_TUNING['gfx942'] = dataclasses.replace(t, decode=decode)\n"
        "r = cc.compile_for(cc.TARGETS['gfx942'], {'mla': cc.cases()['mla decode 1 seqs']})\n"
        "print(r[0].error if isinstance(r[0], cc.Failure) else 'compiled')\n"
    )  # fmt: skip
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert "shared memory, Required: 73728, Hardware limit: 65536" in out.stdout, out.stdout + out.stderr


def test_cli_rejects_an_unknown_arch() -> None:
    out = subprocess.run([sys.executable, "-m", "kvforge.cli", "compile-kernels", "--arch", "sm_75"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2
    assert "--arch must be among" in out.stderr and "sm_75" in out.stderr
