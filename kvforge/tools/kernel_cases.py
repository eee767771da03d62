"""The cases `kvforge compile-kernels` compiles: what the engine launches, at model-like sizes.

Each case calls the engine's own launchers on CPU tensors whose contents are never read (under the
compile-only driver, launches do nothing).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _attention(head_dim: int, num_heads: int, num_kv_heads: int, block_size: int, dtype: torch.dtype,
               kv: str, decode_only: bool) -> None:  # fmt: skip
    from kvforge.kernels.kv_quant import kv_code_dtype
    from kvforge.kernels.paged_attention import paged_attention_triton

    q_lens = [1] * 4 if decode_only else [1, 1, 300, 77]
    seq_lens = [4000, 33, 812, 77]
    code = kv_code_dtype(kv)
    blocks = sum(-(-n // block_size) for n in seq_lens) + 1
    cache = torch.empty(blocks, block_size, num_kv_heads, head_dim, dtype=code or dtype)
    scales = torch.ones(blocks, block_size, num_kv_heads) if code is not None else None
    tables = torch.zeros(len(seq_lens), -(-max(seq_lens) // block_size), dtype=torch.int32)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.empty(sum(q_lens), num_heads, head_dim, dtype=dtype)
    paged_attention_triton(query, cache, cache, tables, starts, torch.tensor(seq_lens, dtype=torch.int32),
                           head_dim**-0.5, scales, scales)  # fmt: skip


def _cache_write(kv: str, dtype: torch.dtype) -> None:
    from kvforge.kernels.cache_write import reshape_and_cache_triton
    from kvforge.kernels.kv_quant import kv_code_dtype

    code = kv_code_dtype(kv)
    key = torch.empty(64, 8, 128, dtype=dtype)
    cache = torch.empty(16, 16, 8, 128, dtype=code or dtype)
    scales = torch.ones(16, 16, 8) if code is not None else None
    reshape_and_cache_triton(key, key, cache, cache, torch.arange(64), scales, scales)


def _row_ops(hidden: int, dtype: torch.dtype) -> None:
    from kvforge.kernels.activation import silu_and_mul_triton
    from kvforge.kernels.rms_norm import fused_add_rms_norm_triton, rms_norm_triton

    x = torch.empty(8, hidden, dtype=dtype)
    rms_norm_triton(x, torch.empty(hidden, dtype=dtype), 1e-6)
    fused_add_rms_norm_triton(x, x, torch.empty(hidden, dtype=dtype), 1e-6)
    silu_and_mul_triton(torch.empty(8, 2 * 14336, dtype=dtype))


def _rotary(head_dim: int, is_neox: bool, dtype: torch.dtype) -> None:
    from kvforge.kernels.rotary import rotary_embedding_triton

    query, key = torch.empty(8, 32, head_dim, dtype=dtype), torch.empty(8, 8, head_dim, dtype=dtype)
    rotary_embedding_triton(torch.arange(8), query, key, torch.empty(4096, head_dim), is_neox)


def _quant_gemm(bits: int, num_tokens: int, dtype: torch.dtype) -> None:
    from kvforge.kernels.quant_gemm import quant_gemm_triton

    n, k, group = 4096, 4096, 128
    scales = torch.empty(n, k // group, dtype=dtype)
    qweight = torch.empty(n, k * bits // 8, dtype=torch.uint8)
    quant_gemm_triton(torch.empty(num_tokens, k, dtype=dtype), qweight, scales, scales, bits)


def _int8_gemm(num_tokens: int) -> None:
    from kvforge.kernels.int8_gemm import int8_gemm_triton

    a, b = torch.empty(num_tokens, 4096, dtype=torch.int8), torch.empty(4096, 4096, dtype=torch.int8)
    int8_gemm_triton(a, b, torch.ones(num_tokens), torch.ones(4096), torch.bfloat16)


def _fused_moe(num_tokens: int) -> None:
    from kvforge.kernels.fused_moe import fused_moe_triton

    experts, hidden, inter, top_k = 8, 1024, 768, 2
    topk_ids = torch.arange(num_tokens * top_k).remainder(experts).view(num_tokens, top_k)
    fused_moe_triton(torch.empty(num_tokens, hidden, dtype=torch.bfloat16),
                     torch.empty(experts, 2 * inter, hidden, dtype=torch.bfloat16),
                     torch.empty(experts, hidden, inter, dtype=torch.bfloat16),
                     torch.ones(num_tokens, top_k), topk_ids)  # fmt: skip


def _mxfp4_moe(num_tokens: int) -> None:
    from kvforge.kernels.mxfp4_moe import mxfp4_moe_triton

    experts, hidden, inter, top_k = 32, 2880, 2880, 4  # a GPT-OSS-20B layer
    topk_ids = torch.arange(num_tokens * top_k).remainder(experts).view(num_tokens, top_k)
    codes = lambda rows, k: (torch.empty(experts, rows, k // 32, 16, dtype=torch.uint8),  # noqa: E731
                             torch.empty(experts, rows, k // 32, dtype=torch.uint8))  # fmt: skip
    mxfp4_moe_triton(torch.empty(num_tokens, hidden, dtype=torch.bfloat16), *codes(2 * inter, hidden),
                     torch.zeros(experts, 2 * inter), *codes(hidden, inter), torch.zeros(experts, hidden),
                     torch.ones(num_tokens, top_k), topk_ids, 1.702, 7.0)  # fmt: skip


def _mla_decode(num_seqs: int) -> None:
    from kvforge.kernels.mla_decode import mla_decode_triton

    latent, rope, heads, block_size = 512, 64, 16, 64
    cache = torch.empty(num_seqs * 8 + 1, block_size, latent + rope, dtype=torch.bfloat16)
    tables = torch.zeros(num_seqs, 8, dtype=torch.int32)
    mla_decode_triton(torch.empty(num_seqs, heads, latent + rope, dtype=torch.bfloat16), cache, tables,
                      torch.full((num_seqs,), 500, dtype=torch.int32), 0.1, latent)  # fmt: skip


def _lora(num_tokens: int, segmented: bool) -> None:
    from kvforge.kernels.lora import lora_expand_triton, lora_shrink_triton

    slots, rank, hidden, num_out = 4, 3 * 16, 4096, 6144  # a QKV layer's shrink, one of its matrices' expand
    x = torch.empty(num_tokens, hidden, dtype=torch.bfloat16)
    token_slots = torch.zeros(num_tokens, dtype=torch.int64)
    h = lora_shrink_triton(x, torch.empty(slots, rank, hidden, dtype=torch.bfloat16), token_slots, segmented)
    lora_expand_triton(h[:, :16], torch.empty(slots, num_out, 16, dtype=torch.bfloat16), token_slots,
                       torch.empty(num_tokens, num_out, dtype=torch.bfloat16), segmented)


def _gated_delta(num_seqs: int, decode: bool) -> None:
    """Qwen3-Next's linear attention (per rank of 2: 16 value heads of key and value dim 128), bf16 activations."""
    from kvforge.kernels.causal_conv1d import causal_conv1d_triton
    from kvforge.kernels.gated_delta_rule import gated_delta_decode_triton, gated_delta_prefill_triton

    heads, dim, channels, bf16 = 16, 128, 4096, torch.bfloat16
    q_lens = [1] * num_seqs if decode else [300, 1, 77, 64][:num_seqs]
    num_tokens = sum(q_lens)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    slots, initial = torch.arange(num_seqs, dtype=torch.int32), torch.ones(num_seqs, dtype=torch.bool)
    causal_conv1d_triton(torch.empty(num_tokens, channels, dtype=bf16), torch.empty(channels, 4, dtype=bf16), None,
                         torch.empty(num_seqs, channels, 3, dtype=bf16), starts, slots, initial, True)
    q = torch.empty(num_tokens, heads, dim, dtype=bf16)
    g, state = torch.empty(num_tokens, heads), torch.empty(num_seqs, heads, dim, dim)
    if decode:
        gated_delta_decode_triton(q, q, q, g, g, state, slots, initial)
    else:
        gated_delta_prefill_triton(q, q, q, g, g, state, starts, slots, initial)


def cases() -> dict[str, Callable[[], None]]:
    """Every launch configuration the engine uses, by name."""
    bf16, fp16 = torch.bfloat16, torch.float16
    found: dict[str, Callable[[], None]] = {}
    for head_dim, dtype in ((64, bf16), (80, bf16), (128, bf16), (128, fp16), (256, bf16)):
        name = f"attention hd{head_dim} {str(dtype)[6:]}"
        found[name] = lambda d=head_dim, t=dtype: _attention(d, 32, 8, 16, t, "auto", False)
    found["attention hd128 MQA block32"] = lambda: _attention(128, 32, 1, 32, bf16, "auto", False)
    found["attention hd128 MHA decodes only"] = lambda: _attention(128, 32, 32, 16, bf16, "auto", True)
    for kv in ("int8", "fp8"):
        found[f"attention hd128 {kv} KV"] = lambda kv=kv: _attention(128, 32, 8, 16, bf16, kv, False)
        found[f"cache write {kv} KV"] = lambda kv=kv: _cache_write(kv, bf16)
    found["cache write"] = lambda: _cache_write("auto", bf16)
    for hidden in (576, 4096, 8192):
        found[f"norms+silu hidden {hidden}"] = lambda h=hidden: _row_ops(h, bf16)
    for head_dim, is_neox in ((128, True), (64, False)):
        found[f"rotary hd{head_dim} {'neox' if is_neox else 'gptj'}"] = lambda d=head_dim, n=is_neox: _rotary(
            d, n, bf16
        )
    for bits in (4, 8):
        for tokens in (1, 256):
            found[f"w{bits}a16 gemm M={tokens}"] = lambda b=bits, m=tokens: _quant_gemm(b, m, fp16)
    for tokens in (1, 256):
        found[f"w8a8 gemm M={tokens}"] = lambda m=tokens: _int8_gemm(m)
        found[f"fused moe {tokens} tokens"] = lambda m=tokens: _fused_moe(m)
        found[f"mxfp4 moe {tokens} tokens"] = lambda m=tokens: _mxfp4_moe(m)
    for num_seqs in (1, 64):
        found[f"mla decode {num_seqs} seqs"] = lambda n=num_seqs: _mla_decode(n)
    # NOTE: one case each: the kernels' compiled variant does not depend on the token count
    found["lora shrink+expand per row 64 tokens"] = lambda: _lora(64, segmented=False)
    found["lora shrink+expand segmented 256 tokens"] = lambda: _lora(256, segmented=True)
    found["gated delta prefill + conv1d"] = lambda: _gated_delta(4, decode=False)
    found["gated delta decode + conv1d"] = lambda: _gated_delta(64, decode=True)
    return found
