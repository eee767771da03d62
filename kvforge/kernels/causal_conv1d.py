"""The causal depthwise conv1d of linear-attention layers, with a conv state per request slot.

Channel c of token t is sum_w weight[c, w] * x[t - (width - 1) + w] (plus bias[c], then SiLU where asked), over the
inputs of the token's own sequence; the inputs before a sequence's first token come from its slot's conv state (the
last width - 1 inputs it saw, oldest first) where has_initial_state, zeros otherwise:

    conv_state[slot]   x of this step (width 4)
    [ s0 s1 s2 ]       [ x0 x1 x2 x3 x4 ]       out[x0] = w0 s0 + w1 s1 + w2 s2 + w3 x0
                                                out[x3] = w0 x0 + w1 x1 + w2 x2 + w3 x3
    new conv_state[slot] = the last width - 1 of [s0 s1 s2 x0 x1 x2 x3 x4] = [x2 x3 x4]

A prompt (chunk) writes its last width - 1 inputs into the state; a decode step (one token) shifts the state by one.
The batch is flat: sequence s owns token rows [query_start_loc[s], query_start_loc[s + 1]) and slot slot_ids[s].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge.kernels.triton_compat import cdiv, jit, next_power_of_2, require_triton, tl
from kvforge.kernels.validation import FLOAT_DTYPES, INDEX_DTYPES, check_same_device, check_tensor

BLOCK_CHANNELS = 128


def _gather(x: torch.Tensor, conv_state: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor,
            initial: torch.Tensor, seq: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """[*seq.shape, channels]: the input at position (within the sequence; < 0: from the conv state) of each seq."""
    width_1 = conv_state.shape[-1]
    from_x = x[(starts[seq] + position).clamp(min=0)]
    from_state = conv_state[slots[seq], :, (width_1 + position).clamp(0, width_1 - 1)]
    from_state = torch.where(initial[seq][..., None], from_state, 0)
    return torch.where((position >= 0)[..., None], from_x, from_state)


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                      query_start_loc: torch.Tensor, slot_ids: torch.Tensor, has_initial_state: torch.Tensor,
                      silu: bool) -> torch.Tensor:
    """x: [num_tokens, channels]; weight: [channels, width]; bias: [channels] or None; conv_state: [num_slots,
    channels, width - 1], updated in place; query_start_loc: [num_seqs + 1]; slot_ids, has_initial_state: [num_seqs].
    Vectorised over the batch (no loop over sequences or tokens), fp32. Returns [num_tokens, channels] in x's dtype."""
    width = weight.shape[1]
    starts, slots = query_start_loc.long(), slot_ids.long()
    initial = has_initial_state.bool()
    lens = starts[1:] - starts[:-1]
    # NOTE: output_size: no host sync, so a compiled decode step traces through
    seq_of_token = torch.repeat_interleave(torch.arange(len(lens), device=x.device), lens,
                                           output_size=x.shape[0])  # [num_tokens]
    position = torch.arange(x.shape[0], device=x.device) - starts[seq_of_token]
    xf, state = x.float(), conv_state.float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if bias is None else bias.float().expand_as(xf)
    for w in range(width):
        taps = _gather(xf, state, starts, slots, initial, seq_of_token, position - (width - 1) + w)
        out = out + weight[:, w].float() * taps
    tail = lens[:, None] - (width - 1) + torch.arange(width - 1, device=x.device)  # [num_seqs, width - 1]
    seqs = torch.arange(len(lens), device=x.device)[:, None].expand_as(tail)
    conv_state[slots] = _gather(xf, state, starts, slots, initial, seqs, tail).transpose(1, 2).to(conv_state.dtype)
    return (F.silu(out) if silu else out).to(x.dtype)


@jit
def _conv1d_kernel(
    out_ptr, x_ptr, weight_ptr, bias_ptr, state_ptr, qsl_ptr, seq_ptr, slot_ptr, init_ptr, channels,
    stride_x, stride_o, stride_w, stride_ss, stride_sc,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Grid (num_tokens, channel blocks): one token's outputs, in fp32."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    c_mask = cols < channels
    seq = tl.load(seq_ptr + row)
    position = row - tl.load(qsl_ptr + seq)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    # NOTE: vectors, not scalars: the interpreter's scalar & vector of bools is no bool mask
    initial = (tl.zeros((BLOCK,), dtype=tl.int32) + tl.load(init_ptr + seq)) != 0
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=c_mask, other=0.0).to(tl.float32)
    for w in tl.static_range(WIDTH):
        p = tl.zeros((BLOCK,), dtype=tl.int64) + (position - (WIDTH - 1) + w)  # a vector: masks of blocks
        from_x = tl.load(x_ptr + (row - (WIDTH - 1) + w) * stride_x + cols, mask=c_mask & (p >= 0), other=0.0)
        state_offsets = slot * stride_ss + cols * stride_sc + (WIDTH - 1 + p)
        from_state = tl.load(state_ptr + state_offsets, mask=c_mask & (p < 0) & initial, other=0.0)
        tap = from_x.to(tl.float32) + from_state.to(tl.float32)
        acc += tap * tl.load(weight_ptr + cols * stride_w + w, mask=c_mask, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + row * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=c_mask)


@jit
def _conv1d_state_kernel(
    x_ptr, state_ptr, qsl_ptr, slot_ptr, init_ptr, channels, stride_x, stride_ss, stride_sc,
    WIDTH: tl.constexpr, BLOCK: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """Grid (num_seqs, channel blocks): the sequence's last width - 1 inputs into its slot (after _conv1d_kernel).
    NOTE: all of a tile's loads come before its store, so a short sequence shifts its own state in place."""
    seq = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    c_mask = cols < channels
    start = tl.load(qsl_ptr + seq).to(tl.int64)
    length = tl.load(qsl_ptr + seq + 1).to(tl.int64) - start
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    initial = (tl.zeros((BLOCK,), dtype=tl.int32) + tl.load(init_ptr + seq)) != 0
    j = tl.arange(0, BLOCK_W)
    j_mask = j < WIDTH - 1
    p = length - (WIDTH - 1) + j  # [BLOCK_W]
    mask = c_mask[:, None] & j_mask[None, :]
    from_x = tl.load(x_ptr + (start + p)[None, :] * stride_x + cols[:, None], mask=mask & (p >= 0)[None, :], other=0.0)
    state_ptrs = state_ptr + slot * stride_ss + cols[:, None] * stride_sc
    from_state = tl.load(state_ptrs + (WIDTH - 1 + p)[None, :], mask=mask & (p < 0)[None, :] & initial[:, None],
                         other=0.0)
    new_state = from_x.to(tl.float32) + from_state.to(tl.float32)
    tl.store(state_ptrs + j[None, :], new_state.to(state_ptr.dtype.element_ty), mask=mask)


def causal_conv1d_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                         query_start_loc: torch.Tensor, slot_ids: torch.Tensor, has_initial_state: torch.Tensor,
                         silu: bool) -> torch.Tensor:
    """causal_conv1d_ref in Triton: the outputs (one program per token and channel block), then the states."""
    require_triton()
    num_tokens, channels = x.shape
    width = weight.shape[-1]
    num_seqs = slot_ids.shape[0]
    check_tensor("x", x, shape=(num_tokens, channels), dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, shape=(channels, width), dtypes=FLOAT_DTYPES)
    if bias is not None:
        check_tensor("bias", bias, shape=(channels,), dtypes=FLOAT_DTYPES)
    if width < 2:
        raise ValueError(f"the conv width must be >= 2, got {width}")
    check_tensor("conv_state", conv_state, shape=(None, channels, width - 1), dtypes=FLOAT_DTYPES)
    check_tensor("query_start_loc", query_start_loc, shape=(num_seqs + 1,), dtypes=INDEX_DTYPES)
    check_tensor("slot_ids", slot_ids, shape=(num_seqs,), dtypes=INDEX_DTYPES)
    check_tensor("has_initial_state", has_initial_state, shape=(num_seqs,), dtypes=(torch.bool, torch.int32))
    check_same_device(x=x, weight=weight, conv_state=conv_state, query_start_loc=query_start_loc, slot_ids=slot_ids)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_tokens == 0 or num_seqs == 0:
        return out
    # the sequence of each token, without a host sync: the count of sequence ends at or before it
    seq_of_token = torch.searchsorted(query_start_loc[1:].contiguous(),
                                      torch.arange(num_tokens, device=x.device, dtype=query_start_loc.dtype),
                                      right=True)
    block = min(BLOCK_CHANNELS, next_power_of_2(channels))
    has_initial_state = has_initial_state.to(torch.int32)
    _conv1d_kernel[(num_tokens, cdiv(channels, block))](
        out, x, weight, bias if bias is not None else weight, conv_state, query_start_loc, seq_of_token, slot_ids,
        has_initial_state, channels, x.stride(0), out.stride(0), weight.stride(0), conv_state.stride(0),
        conv_state.stride(1), WIDTH=width, HAS_BIAS=bias is not None, SILU=silu, BLOCK=block,
    )  # fmt: skip
    _conv1d_state_kernel[(num_seqs, cdiv(channels, block))](
        x, conv_state, query_start_loc, slot_ids, has_initial_state, channels, x.stride(0), conv_state.stride(0),
        conv_state.stride(1), WIDTH=width, BLOCK=block, BLOCK_W=next_power_of_2(width - 1),
    )  # fmt: skip
    return out
