"""Quantized KV cache (int8 / fp8 codes + per-(token, head) scales): the cache write round-trips within
one quantization step, and every attention path (Triton prefill + decode, CPU SDPA, C++ decode) matches
the reference attending over the dequantized cache."""

from __future__ import annotations

import functools

import pytest
import torch

import kvforge.kernels.cpu.paged_attention as paged_attention_cpu_module
from kvforge.kernels.cache_write import reshape_and_cache_ref, reshape_and_cache_triton
from kvforge.kernels.cpu.extension import cpu_kernels
from kvforge.kernels.cpu.paged_attention import paged_attention_cpu
from kvforge.kernels.kv_quant import (
    CODE_MAX,
    FP8_UNIT,
    check_triton_code_dtype,
    dequantize_kv,
    kv_code_dtype,
    quantize_kv,
)
from kvforge.kernels.paged_attention import paged_attention_ref, paged_attention_triton
from kvforge.platforms import Platform, current_platform
from tests.kernels.attention_batches import TOLERANCE, dequantized_reference, make_paged_batch, quantize_batch_cache

CPU_CODE_DTYPES = [torch.int8, torch.float8_e4m3fn]  # what --kv-cache-dtype gives on the CPU
CODE_DTYPES = [*CPU_CODE_DTYPES, torch.float8_e4m3fnuz]  # and fp8 on the MI300 (gfx942)
FP8_RELATIVE_STEP = 2.0**-4  # half the spacing of e4m3's 3 mantissa bits, relative to the value


def _max_error(x: torch.Tensor, scales: torch.Tensor, code_dtype: torch.dtype) -> torch.Tensor:
    """The largest |dequantized - x| that rounding to the code grid allows, per element (+ fp32 slack)."""
    scales = scales.float()[..., None]
    if code_dtype == torch.int8:
        bound = scales / 2
    else:  # nearest e4m3 value: a relative half step, or half the subnormal spacing near zero (2**-9 in
        # e4m3fn code units, 2**-10 in fnuz's)
        bound = torch.maximum(x.float().abs() * FP8_RELATIVE_STEP, scales * 2.0**-10 * FP8_UNIT[code_dtype])
    return bound * (1 + 1e-5) + 1e-7


@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
def test_quantize_round_trip(code_dtype: torch.dtype) -> None:
    x = torch.randn(50, 4, 96) * torch.logspace(-3, 2, 50)[:, None, None]
    x[3, 1] = 0.0  # an all-zero row: scale 0, codes 0, no NaN
    codes, scales = quantize_kv(x, code_dtype)
    assert codes.dtype == code_dtype and scales.shape == (50, 4) and scales.dtype == torch.float32
    assert float(scales[3, 1]) == 0.0
    assert codes.float().abs().amax() <= CODE_MAX[code_dtype]
    # the absmax element of every non-zero row lands on the largest code
    largest_codes = codes.float().abs().amax(-1)[scales > 0]
    assert torch.equal(largest_codes, torch.full_like(largest_codes, CODE_MAX[code_dtype]))
    error = (dequantize_kv(codes, scales, torch.float32) - x).abs()
    assert (error <= _max_error(x, scales, code_dtype)).all()


@pytest.mark.parametrize(("kind", "arch", "fp8"), [
    ("cuda", "sm_90", torch.float8_e4m3fn), ("cuda", "sm_89", torch.float8_e4m3fn), ("cuda", "sm_80", None),
    ("rocm", "gfx942", torch.float8_e4m3fnuz), ("rocm", "gfx950", torch.float8_e4m3fn), ("rocm", "gfx90a", None),
    ("cpu", "x86_64", torch.float8_e4m3fn),
])  # fmt: skip
def test_fp8_cache_needs_e4m3_on_the_gpu(kind: str, arch: str, fp8: torch.dtype | None) -> None:
    """--kv-cache-dtype fp8 is the platform's own e4m3 (fnuz on the MI300), refused where it has none."""
    platform = Platform(kind, "a device", arch, 32, 1, 2**30, None)
    for unquantized in (torch.int8, torch.bfloat16, torch.float16, torch.float32):
        check_triton_code_dtype(unquantized, platform)
    code_dtype = kv_code_dtype("fp8", platform)
    assert code_dtype == (fp8 or torch.float8_e4m3fn)
    if fp8 is not None:
        check_triton_code_dtype(code_dtype, platform)
    else:
        with pytest.raises(ValueError, match="use --kv-cache-dtype int8"):
            check_triton_code_dtype(code_dtype, platform)
    if kind != "cpu":  # the other variant is refused on every GPU
        other = torch.float8_e4m3fn if code_dtype == torch.float8_e4m3fnuz else torch.float8_e4m3fnuz
        with pytest.raises(ValueError, match="use --kv-cache-dtype int8"):
            check_triton_code_dtype(other, platform)


def skip_without_fp8(code_dtype: torch.dtype, device: torch.device) -> None:
    """On a GPU without e4m3 support the fp8 Triton cases are skipped (the launchers refuse them); so are
    the fnuz cases on a Triton whose interpreter has no fnuz type (3.6 raises "fail to convert fp8e4b8")."""
    if device.type == "cuda":
        try:
            check_triton_code_dtype(code_dtype, current_platform())
        except ValueError as err:
            pytest.skip(str(err))
    elif code_dtype == torch.float8_e4m3fnuz and not _interpreter_converts_fnuz():
        pytest.skip("this Triton's interpreter cannot convert float8_e4m3fnuz")


@functools.cache
def _interpreter_converts_fnuz() -> bool:
    from triton.runtime.errors import InterpreterError

    cache = torch.zeros(1, 16, 1, 16, dtype=torch.float8_e4m3fnuz)
    try:
        reshape_and_cache_triton(torch.ones(1, 1, 16), torch.ones(1, 1, 16), cache, cache.clone(), torch.zeros(1,
                                 dtype=torch.int64), torch.zeros(1, 16, 1), torch.zeros(1, 16, 1))  # fmt: skip
    except InterpreterError:
        return False
    return True


def test_kv_cache_dtype_names() -> None:
    assert kv_code_dtype("auto") is None
    assert kv_code_dtype("int8") == torch.int8
    assert kv_code_dtype("fp8") == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        kv_code_dtype("int4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_quantized_cache_write(device: torch.device, dtype: torch.dtype, code_dtype: torch.dtype,
                               block_size: int) -> None:
    skip_without_fp8(code_dtype, device)
    num_blocks, num_kv_heads, head_dim = 6, 3, 40
    key = (torch.randn(7, num_kv_heads, head_dim) * 3).to(device, dtype)
    value = torch.randn(7, num_kv_heads, head_dim).to(device, dtype)
    slots = torch.tensor([5, block_size, -1, 3 * block_size + 7, 2 * block_size - 1, 1, num_blocks * block_size - 1],
                         device=device)
    written = slots[slots >= 0]

    def write(fn):
        caches = [torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, device=device).to(code_dtype)
                  for _ in range(2)]
        scales = [torch.full((num_blocks, block_size, num_kv_heads), float("nan"), device=device)
                  for _ in range(2)]
        fn(key, value, caches[0], caches[1], slots, scales[0], scales[1])
        return caches, scales

    (triton_k, triton_v), (triton_ks, triton_vs) = write(reshape_and_cache_triton)
    (ref_k, ref_v), (ref_ks, ref_vs) = write(reshape_and_cache_ref)
    for got, want in ((triton_ks, ref_ks), (triton_vs, ref_vs)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0, equal_nan=True)
        assert int(got.isnan().sum()) == (num_blocks * block_size - len(written)) * num_kv_heads
    for got, want in ((triton_k, ref_k), (triton_v, ref_v)):  # a rounding tie may go either way: one code step
        step = 1.0 if code_dtype == torch.int8 else want.float().abs() * 2.0**-3 + 2.0**-9
        assert ((got.float() - want.float()).abs() <= step).all()
    flat = lambda t: t.flatten(0, 1)[written]  # noqa: E731
    for codes, scales, x in ((ref_k, ref_ks, key), (ref_v, ref_vs, value), (triton_k, triton_ks, key),
                             (triton_v, triton_vs, value)):
        x = x[slots >= 0].float()
        error = (dequantize_kv(flat(codes), flat(scales), torch.float32) - x).abs()
        assert (error <= _max_error(x, flat(scales), code_dtype) * (1 + 1e-3)).all()


def test_quantized_cache_write_rejects_half_the_scales(device: torch.device) -> None:
    cache = torch.zeros(2, 16, 2, 32, dtype=torch.int8, device=device)
    scale = torch.zeros(2, 16, 2, device=device)
    key = torch.randn(3, 2, 32, device=device)
    slots = torch.arange(3, device=device)
    with pytest.raises(ValueError, match="go together"):
        reshape_and_cache_triton(key, key, cache, cache, slots, scale, None)
    with pytest.raises(ValueError, match="key_scale must have shape"):
        reshape_and_cache_triton(key, key, cache, cache, slots, scale[:, :8], scale[:, :8])
    with pytest.raises(ValueError, match="key_cache must have a dtype"):  # int8 codes without scales
        reshape_and_cache_triton(key, key, cache, cache, slots)


def _quantized_batch(q_lens: list[int], seq_lens: list[int], *, group: int, block_size: int, dtype: torch.dtype,
                     code_dtype: torch.dtype, device: torch.device | str = "cpu", head_dim: int = 64):
    batch = make_paged_batch(q_lens, seq_lens, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                             block_size=block_size, dtype=dtype, device=device)
    batch, key_scale, value_scale = quantize_batch_cache(batch, code_dtype)
    expected = dequantized_reference(batch, key_scale, value_scale, head_dim**-0.5)
    return batch, key_scale, value_scale, expected


def _assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOLERANCE[got.dtype]
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("block_size", [16, 32])
def test_triton_attention_over_quantized_cache(device: torch.device, dtype: torch.dtype, code_dtype: torch.dtype,
                                               group: int, block_size: int) -> None:
    skip_without_fp8(code_dtype, device)
    # decode, chunk after 23 cached tokens, decode, fresh prefill, decode; contexts end mid-block
    batch, key_scale, value_scale, expected = _quantized_batch(
        [1, 37, 1, 20, 1], [50, 60, 17, 20, 33], group=group, block_size=block_size, dtype=dtype,
        code_dtype=code_dtype, device=device)
    scale = 64**-0.5
    # the reference reads padded slots before masking them: it gets finite scales there
    _assert_close(paged_attention_ref(*batch.args(), scale, key_scale.nan_to_num(), value_scale.nan_to_num()),
                  expected)
    out = torch.full_like(batch.query, float("nan"))
    paged_attention_triton(*batch.args(), scale, key_scale, value_scale, out=out, num_splits=2)
    _assert_close(out, expected)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_decode_only_over_int8_cache(device: torch.device, num_splits: int) -> None:
    """Only decodes (no prefill launch), odd head size, contexts shorter than one key tile included."""
    seq_lens = [1, 15, 16, 17, 33, 100]
    batch, key_scale, value_scale, expected = _quantized_batch(
        [1] * len(seq_lens), seq_lens, group=3, block_size=16, dtype=torch.float16, code_dtype=torch.int8,
        device=device, head_dim=80)
    out = paged_attention_triton(*batch.args(), 80**-0.5, key_scale, value_scale, num_splits=num_splits)
    _assert_close(out, expected)


def test_triton_attention_rejects_bad_scales(device: torch.device) -> None:
    batch, key_scale, value_scale, _ = _quantized_batch([1, 3], [5, 9], group=1, block_size=16,
                                                        dtype=torch.float32, code_dtype=torch.int8, device=device)
    with pytest.raises(ValueError, match="go together"):
        paged_attention_triton(*batch.args(), 0.125, key_scale)
    with pytest.raises(ValueError, match="value_scale must have a dtype"):
        paged_attention_triton(*batch.args(), 0.125, key_scale, value_scale.half())


@pytest.mark.parametrize("native", [True, False], ids=["cpp-decode", "sdpa-decode"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("code_dtype", CPU_CODE_DTYPES)
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [16, 32])
def test_cpu_attention_over_quantized_cache(monkeypatch: pytest.MonkeyPatch, native: bool, dtype: torch.dtype,
                                            code_dtype: torch.dtype, group: int, block_size: int) -> None:
    if native:
        assert cpu_kernels() is not None, "the C++ CPU kernels failed to build"
    else:
        monkeypatch.setattr(paged_attention_cpu_module, "cpu_kernels", lambda: None)
    q_lens = [1, 1, 37, 1, 20, 5]
    seq_lens = [70, 3, 37, 150, 20 + 45, 5 + 2 * block_size]
    batch, key_scale, value_scale, expected = _quantized_batch(
        q_lens, seq_lens, group=group, block_size=block_size, dtype=dtype, code_dtype=code_dtype)
    # the torch paths read padded slots before masking them: keep the scales finite there
    key_scale, value_scale = key_scale.nan_to_num(), value_scale.nan_to_num()
    _assert_close(paged_attention_cpu(*batch.args(), 64**-0.5, key_scale, value_scale), expected)
    decode_only, key_scale, value_scale, expected = _quantized_batch(
        [1] * 5, [1, 16, 17, 90, 200], group=group, block_size=block_size, dtype=dtype, code_dtype=code_dtype)
    key_scale, value_scale = key_scale.nan_to_num(), value_scale.nan_to_num()
    _assert_close(paged_attention_cpu(*decode_only.args(), 64**-0.5, key_scale, value_scale), expected)
