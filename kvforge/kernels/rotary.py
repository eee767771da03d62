"""Rotary position embedding applied in place of a copy to queries and keys."""

from __future__ import annotations

import torch

from kvforge.kernels.triton_compat import jit, next_power_of_2, require_triton, tl
from kvforge.kernels.tuning import kernel_tuning
from kvforge.kernels.validation import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_matches,
    check_same_device,
    check_tensor,
)
from kvforge.platforms import Platform


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    # x: [num_tokens, num_heads, rot_dim]; cos/sin: [num_tokens, 1, rot_dim // 2]
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first rot_dim features of every head.

    positions: [num_tokens] int; query: [num_tokens, num_heads, head_dim];
    key: [num_tokens, num_kv_heads, head_dim]; cos_sin_cache: [max_position, rot_dim] fp32 with
    cos in the first half of the last dim and sin in the second. Computed in fp32.
    """
    rot_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    outs = []
    for x in (query, key):
        rotated = _rotate(x[..., :rot_dim].float(), cos, sin, is_neox).to(x.dtype)
        outs.append(rotated if rot_dim == x.shape[-1] else torch.cat((rotated, x[..., rot_dim:]), dim=-1))
    return outs[0], outs[1]


@jit
def _rotate_heads(
    out_ptr, x_ptr, token, stride_xt, stride_xh, stride_ot, stride_oh, cos, sin,
    NUM_HEADS: tl.constexpr, ROT_HALF: tl.constexpr, PASS_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, IS_NEOX: tl.constexpr,
):  # fmt: skip
    """Rotate the first 2 * ROT_HALF features of every head of one token; copy the PASS_DIM after them.

    neox pairs feature i with i + ROT_HALF; GPT-J pairs 2i with 2i + 1."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    pairs = tl.arange(0, BLOCK_R)[None, :]
    mask = (heads < NUM_HEADS) & (pairs < ROT_HALF)
    if IS_NEOX:
        first, second = pairs, pairs + ROT_HALF
    else:
        first, second = 2 * pairs, 2 * pairs + 1
    x_row = x_ptr + token * stride_xt + heads * stride_xh
    out_row = out_ptr + token * stride_ot + heads * stride_oh
    x1 = tl.load(x_row + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + second, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_row + first, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(out_row + second, (x2 * cos + x1 * sin).to(dtype), mask=mask)
    if PASS_DIM > 0:
        rest = 2 * ROT_HALF + tl.arange(0, BLOCK_P)[None, :]
        rest_mask = (heads < NUM_HEADS) & (rest < 2 * ROT_HALF + PASS_DIM)
        tl.store(out_row + rest, tl.load(x_row + rest, mask=rest_mask), mask=rest_mask)


@jit
def _rotary_kernel(
    query_out_ptr, key_out_ptr, query_ptr, key_ptr, positions_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, ROT_HALF: tl.constexpr, PASS_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    IS_NEOX: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    pairs = tl.arange(0, BLOCK_R)
    cos = tl.load(cos_sin_ptr + position * stride_cs + pairs, mask=pairs < ROT_HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + position * stride_cs + ROT_HALF + pairs, mask=pairs < ROT_HALF, other=0.0)
    cos = cos.to(tl.float32)[None, :]
    sin = sin.to(tl.float32)[None, :]
    _rotate_heads(query_out_ptr, query_ptr, token, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin,
                  NUM_HEADS, ROT_HALF, PASS_DIM, BLOCK_H, BLOCK_R, BLOCK_P, IS_NEOX)  # fmt: skip
    _rotate_heads(key_out_ptr, key_ptr, token, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin,
                  NUM_KV_HEADS, ROT_HALF, PASS_DIM, BLOCK_KH, BLOCK_R, BLOCK_P, IS_NEOX)  # fmt: skip


def _check_rotary_inputs(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    check_tensor("query", query, shape=(None, None, None), dtypes=FLOAT_DTYPES)
    num_tokens, _, head_dim = query.shape
    check_tensor("key", key, shape=(num_tokens, None, head_dim), dtypes=(query.dtype,))
    check_tensor("positions", positions, shape=(num_tokens,), dtypes=INDEX_DTYPES)
    check_tensor("cos_sin_cache", cos_sin_cache, shape=(None, None), dtypes=FLOAT_DTYPES)
    check_same_device(positions=positions, query=query, key=key, cos_sin_cache=cos_sin_cache)
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % 2 or not 0 < rot_dim <= head_dim:
        raise ValueError(
            f"cos_sin_cache's last dim (rot_dim) must be even and in [2, {head_dim}], got {rot_dim}"
        )


def rotary_embedding_triton(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    *,
    query_out: torch.Tensor | None = None,
    key_out: torch.Tensor | None = None,
    platform: Platform | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_embedding_ref in Triton, one program per token for all its query and key heads.

    query_out/key_out: optional contiguous buffers like query/key (default: new tensors)."""
    require_triton()
    _check_rotary_inputs(positions, query, key, cos_sin_cache)
    if query_out is None:
        query_out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if key_out is None:
        key_out = torch.empty_like(key, memory_format=torch.contiguous_format)
    check_matches(
        "query_out", query_out, shape=query.shape, dtype=query.dtype, device=query.device, contiguous=True
    )
    check_matches("key_out", key_out, shape=key.shape, dtype=key.dtype, device=key.device, contiguous=True)
    num_tokens, num_heads, head_dim = query.shape
    if num_tokens == 0:
        return query_out, key_out
    rot_half = cos_sin_cache.shape[1] // 2
    pass_dim = head_dim - 2 * rot_half
    block_h, block_kh = next_power_of_2(num_heads), next_power_of_2(key.shape[1])
    _rotary_kernel[(num_tokens,)](
        query_out, key_out, query, key, positions, cos_sin_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        query_out.stride(0), query_out.stride(1), key_out.stride(0), key_out.stride(1),
        cos_sin_cache.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=key.shape[1], ROT_HALF=rot_half, PASS_DIM=pass_dim,
        BLOCK_H=block_h, BLOCK_KH=block_kh, BLOCK_R=next_power_of_2(rot_half),
        BLOCK_P=next_power_of_2(max(pass_dim, 1)), IS_NEOX=is_neox,
        num_warps=kernel_tuning(platform).rows.num_warps(block_h * head_dim),
    )  # fmt: skip
    return query_out, key_out
