"""The gated delta rule of Gated DeltaNet layers (Qwen3-Next, Qwen3.5): chunked prefill and the one-token decode step.

Per head, with a state S [key_dim, value_dim] kept per request slot, each token t (q, k L2-normalised, q scaled by
key_dim^-0.5; g <= 0 a log decay, beta in (0, 1)) does

    S = exp(g_t) S;   delta_t = beta_t (v_t - S^T k_t);   S = S + k_t delta_t^T;   o_t = S^T q_t

A chunk of L tokens does the same at once (G: the cumulative sum of g within the chunk, S0: the state before it):

    (I + A) delta = beta (v - exp(G) K S0),   A[i, j] = beta_i exp(G_i - G_j) k_i.k_j   for j < i (unit lower solve)
    o = exp(G) Q S0 + (exp(G_i - G_j) q_i.k_j  for j <= i) delta
    S = exp(G_L) S0 + sum_j exp(G_L - G_j) k_j delta_j^T

The batch is flat: sequence s owns token rows [query_start_loc[s], query_start_loc[s + 1]) and the state slot
slot_ids[s]; it starts from that slot's state where has_initial_state[s] (a later chunk of a prompt, a decode),
from zeros otherwise. States are float32 and updated in place.
"""

from __future__ import annotations

import torch

from kvforge.kernels.triton_compat import cdiv, jit, next_power_of_2, require_triton, tl
from kvforge.kernels.validation import FLOAT_DTYPES, INDEX_DTYPES, check_same_device, check_tensor

# NOTE: launch parameters not yet tuned on a device. The prefill kernel compiles for every target of `kvforge
# compile-kernels` but spills registers there (12-15 KB on NVIDIA, ~0.9 KB on CDNA at 8 warps): its row-by-row
# forward substitution keeps [CHUNK_SIZE, CHUNK_SIZE] tiles live; a blocked triangular solve would not.
CHUNK_SIZE = 64
VALUE_BLOCK = 16  # value columns of the state per program
PREFILL_NUM_WARPS = 8
L2_EPS = 1e-6


def _l2_normalise(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def _chunk_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of one sequence, fp32: q, k [heads, L, key_dim] (normalised, q scaled), v [heads, L, value_dim],
    g, beta [heads, L], state [heads, key_dim, value_dim] -> (out [heads, L, value_dim], the state after it)."""
    length = g.shape[-1]
    cum = g.cumsum(-1)  # [heads, L]
    causal = torch.ones(length, length, dtype=torch.bool, device=g.device).tril()
    decay = torch.where(causal, cum[:, :, None] - cum[:, None, :], float("-inf")).exp()  # [heads, L, L]
    a = (beta[..., None] * decay * (k @ k.transpose(-1, -2))).tril(-1)
    rhs = beta[..., None] * (v - cum.exp()[..., None] * (k @ state))
    eye = torch.eye(length, device=g.device)
    delta = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    out = cum.exp()[..., None] * (q @ state) + (decay * (q @ k.transpose(-1, -2))) @ delta
    last = cum[:, -1:]  # [heads, 1]
    state = last.exp()[..., None] * state + (k * (last - cum).exp()[..., None]).transpose(-1, -2) @ delta
    return out, state


def gated_delta_prefill_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            state: torch.Tensor, query_start_loc: torch.Tensor, slot_ids: torch.Tensor,
                            has_initial_state: torch.Tensor) -> torch.Tensor:
    """The chunked gated delta rule over a flat batch, in fp32 (CHUNK_SIZE tokens at a time).

    q, k: [num_tokens, heads, key_dim]; v: [num_tokens, heads, value_dim]; g, beta: [num_tokens, heads];
    state: [num_slots, heads, key_dim, value_dim] float32, updated in place; query_start_loc: [num_seqs + 1];
    slot_ids, has_initial_state: [num_seqs]. Returns out: [num_tokens, heads, value_dim] in v's dtype."""
    scale = q.shape[-1] ** -0.5
    qs, ks = _l2_normalise(q.float()) * scale, _l2_normalise(k.float())
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    bounds = query_start_loc.tolist()
    for seq, (slot, initial) in enumerate(zip(slot_ids.tolist(), has_initial_state.tolist())):
        s = state[slot].float() if initial else state.new_zeros(state.shape[1:], dtype=torch.float32)
        for first in range(bounds[seq], bounds[seq + 1], CHUNK_SIZE):
            rows = slice(first, min(first + CHUNK_SIZE, bounds[seq + 1]))
            chunk_out, s = _chunk_ref(qs[rows].transpose(0, 1), ks[rows].transpose(0, 1),
                                      v[rows].float().transpose(0, 1), g[rows].float().T, beta[rows].float().T, s)
            out[rows] = chunk_out.transpose(0, 1)
        state[slot] = s
    return out.to(v.dtype)


def gated_delta_decode_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, slot_ids: torch.Tensor, has_initial_state: torch.Tensor
                           ) -> torch.Tensor:
    """One token per sequence (row s is sequence s), vectorised over the batch, in fp32: the recurrence's step.
    Shapes as gated_delta_prefill_ref with num_tokens = num_seqs."""
    scale = q.shape[-1] ** -0.5
    qs, ks = _l2_normalise(q.float()) * scale, _l2_normalise(k.float())
    slots = slot_ids.long()
    initial = has_initial_state.bool().view(-1, 1, 1, 1)
    s = torch.where(initial, state[slots].float(), 0.0)  # [num_seqs, heads, key_dim, value_dim]
    s = s * g.float().exp()[..., None, None]
    delta = beta.float()[..., None] * (v.float() - (s * ks[..., None]).sum(-2))  # [num_seqs, heads, value_dim]
    s = s + ks[..., None] * delta[..., None, :]
    state[slots] = s
    return (s * qs[..., None]).sum(-2).to(v.dtype)


@jit
def _load_rows(ptr, rows, head, stride_t, stride_h, cols, row_mask, col_mask):
    """[len(rows), len(cols)] float32: row r, head, column c of a [tokens, heads, dim] tensor (0 where masked)."""
    offsets = rows.to(tl.int64)[:, None] * stride_t + head * stride_h + cols[None, :]
    return tl.load(ptr + offsets, mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)


@jit
def _l2_normalise_rows(x, eps):
    return x * tl.rsqrt(tl.sum(x * x, 1) + eps)[:, None]


@jit
def _gated_delta_prefill_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr, qsl_ptr, slot_ptr, init_ptr,
    key_dim, value_dim, scale, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_bt, stride_bh,
    stride_ot, stride_oh, stride_ss, stride_sh, stride_sk,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Grid (num_seqs, heads, value blocks): one program walks its sequence's chunks, its BV columns of the state in
    registers (fp32). NOTE: the state's value columns are independent of each other (A and the decays are not per
    column), so a program needs only its own."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    start = tl.load(qsl_ptr + seq)
    end = tl.load(qsl_ptr + seq + 1)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    rk, rv, rt = tl.arange(0, BK), tl.program_id(2) * BV + tl.arange(0, BV), tl.arange(0, BT)
    k_mask, v_mask = rk < key_dim, rv < value_dim
    s_ptrs = state_ptr + slot * stride_ss + head * stride_sh + rk[:, None] * stride_sk + rv[None, :]
    s_mask = k_mask[:, None] & v_mask[None, :]
    state = tl.load(s_ptrs, mask=s_mask, other=0.0)
    state = tl.where(tl.load(init_ptr + seq) != 0, state, 0.0)
    causal = rt[:, None] >= rt[None, :]
    strict = rt[:, None] > rt[None, :]
    for first in range(start, end, BT):
        rows = first + rt
        t_mask = rows < end
        # NOTE: padding rows get g = 0 and beta = 0: their delta is 0 and the cumulative decay stays the last row's
        g = tl.load(g_ptr + rows.to(tl.int64) * stride_gt + head * stride_gh, mask=t_mask, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + rows.to(tl.int64) * stride_bt + head * stride_bh, mask=t_mask, other=0.0)
        beta = beta.to(tl.float32)
        cum = tl.cumsum(g, 0)  # [BT]
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))  # [BT, BT]
        # NOTE: what needs q and k is computed before the substitution loop, so the [BT, BK] tiles are not live
        # across it (they spilled registers); k is loaded again for the state update after it
        k = _l2_normalise_rows(_load_rows(k_ptr, rows, head, stride_kt, stride_kh, rk, t_mask, k_mask), eps)
        v = _load_rows(v_ptr, rows, head, stride_vt, stride_vh, rv, t_mask, v_mask)
        a = tl.where(strict, beta[:, None] * decay * tl.dot(k, tl.trans(k), input_precision="ieee"), 0.0)
        delta = beta[:, None] * (v - tl.exp(cum)[:, None] * tl.dot(k, state, input_precision="ieee"))  # [BT, BV]
        q = _l2_normalise_rows(_load_rows(q_ptr, rows, head, stride_qt, stride_qh, rk, t_mask, k_mask), eps) * scale
        qk = tl.dot(q, tl.trans(k), input_precision="ieee") * decay
        out = tl.exp(cum)[:, None] * tl.dot(q, state, input_precision="ieee")
        # forward substitution of the unit lower triangular (I + A): row i takes the rows before it, final already
        for i in range(1, BT):
            is_row = rt[:, None] == i
            a_row = tl.sum(tl.where(is_row, a, 0.0), 0)  # [BT]
            row = tl.sum(tl.where(is_row, delta, 0.0), 0) - tl.sum(a_row[:, None] * delta, 0)  # [BV]
            delta = tl.where(is_row, row[None, :], delta)
        out += tl.dot(qk, delta, input_precision="ieee")
        o_offsets = rows.to(tl.int64)[:, None] * stride_ot + head * stride_oh + rv[None, :]
        tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & v_mask[None, :])
        last = tl.sum(tl.where(rt == BT - 1, cum, 0.0), 0)
        k = _l2_normalise_rows(_load_rows(k_ptr, rows, head, stride_kt, stride_kh, rk, t_mask, k_mask), eps)
        state = tl.exp(last) * state + tl.dot(tl.trans(k * tl.exp(last - cum)[:, None]), delta, input_precision="ieee")
    tl.store(s_ptrs, state, mask=s_mask)


@jit
def _gated_delta_decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr, slot_ptr, init_ptr,
    key_dim, value_dim, scale, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_bt, stride_bh,
    stride_ot, stride_oh, stride_ss, stride_sh, stride_sk,
    BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Grid (num_seqs, heads, value blocks): one token's step of the recurrence on its BV columns of the state of its
    slot, in place (fp32)."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    rk, rv = tl.arange(0, BK), tl.program_id(2) * BV + tl.arange(0, BV)
    k_mask, v_mask = rk < key_dim, rv < value_dim
    s_ptrs = state_ptr + slot * stride_ss + head * stride_sh + rk[:, None] * stride_sk + rv[None, :]
    s_mask = k_mask[:, None] & v_mask[None, :]
    state = tl.load(s_ptrs, mask=s_mask, other=0.0)
    state = tl.where(tl.load(init_ptr + seq) != 0, state, 0.0)
    q = tl.load(q_ptr + seq * stride_qt + head * stride_qh + rk, mask=k_mask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + seq * stride_kt + head * stride_kh + rk, mask=k_mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + seq * stride_vt + head * stride_vh + rv, mask=v_mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + seq * stride_gt + head * stride_gh).to(tl.float32)
    beta = tl.load(beta_ptr + seq * stride_bt + head * stride_bh).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + eps) * scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + eps)
    state = state * tl.exp(g)
    delta = beta * (v - tl.sum(state * k[:, None], 0))  # [BV]
    state = state + k[:, None] * delta[None, :]
    out = tl.sum(state * q[:, None], 0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + rv, out.to(out_ptr.dtype.element_ty), mask=v_mask)
    tl.store(s_ptrs, state, mask=s_mask)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           state: torch.Tensor, slot_ids: torch.Tensor, has_initial_state: torch.Tensor) -> None:
    num_tokens, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    check_tensor("q", q, shape=(num_tokens, heads, key_dim), dtypes=FLOAT_DTYPES)
    check_tensor("k", k, shape=(num_tokens, heads, key_dim), dtypes=FLOAT_DTYPES)
    check_tensor("v", v, shape=(num_tokens, heads, value_dim), dtypes=FLOAT_DTYPES)
    check_tensor("g", g, shape=(num_tokens, heads), dtypes=FLOAT_DTYPES, unit_last_stride=False)
    check_tensor("beta", beta, shape=(num_tokens, heads), dtypes=FLOAT_DTYPES, unit_last_stride=False)
    check_tensor("state", state, shape=(None, heads, key_dim, value_dim), dtypes=(torch.float32,))
    if not state.is_contiguous():
        raise ValueError(f"state must be contiguous, got strides {state.stride()}")
    check_tensor("slot_ids", slot_ids, shape=(slot_ids.shape[0],), dtypes=INDEX_DTYPES)
    check_tensor("has_initial_state", has_initial_state, shape=(slot_ids.shape[0],),
                 dtypes=(torch.bool, torch.int32))
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, state=state, slot_ids=slot_ids)


def _strides(q, k, v, g, beta, out, state) -> tuple[int, ...]:  # noqa: ANN001
    return (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
            beta.stride(0), beta.stride(1), out.stride(0), out.stride(1), state.stride(0), state.stride(1),
            state.stride(2))


def _dims(q: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
    """(BK, BV): the whole key dim, value columns in blocks of up to VALUE_BLOCK (16: the smallest tl.dot tile)."""
    return max(16, next_power_of_2(q.shape[-1])), min(VALUE_BLOCK, max(16, next_power_of_2(v.shape[-1])))


def gated_delta_prefill_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor, query_start_loc: torch.Tensor,
                               slot_ids: torch.Tensor, has_initial_state: torch.Tensor) -> torch.Tensor:
    """gated_delta_prefill_ref in Triton: one program per (sequence, head, value block), CHUNK_SIZE tokens an iteration.
    NOTE: every product runs in fp32 ("ieee"): the state carries the whole prompt, and tf32 rounding compounds."""
    require_triton()
    _check(q, k, v, g, beta, state, slot_ids, has_initial_state)
    check_tensor("query_start_loc", query_start_loc, shape=(slot_ids.shape[0] + 1,), dtypes=INDEX_DTYPES)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if slot_ids.shape[0] == 0 or q.shape[0] == 0:
        return out
    block_k, block_v = _dims(q, v)
    _gated_delta_prefill_kernel[(slot_ids.shape[0], q.shape[1], cdiv(v.shape[-1], block_v))](
        q, k, v, g, beta, out, state, query_start_loc, slot_ids, has_initial_state,
        q.shape[-1], v.shape[-1], q.shape[-1] ** -0.5, L2_EPS, *_strides(q, k, v, g, beta, out, state),
        BT=CHUNK_SIZE, BK=block_k, BV=block_v, num_warps=PREFILL_NUM_WARPS,
    )  # fmt: skip
    return out


def gated_delta_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                              beta: torch.Tensor, state: torch.Tensor, slot_ids: torch.Tensor,
                              has_initial_state: torch.Tensor) -> torch.Tensor:
    """gated_delta_decode_ref in Triton: one program per (sequence, head, value block), the state updated in place."""
    require_triton()
    _check(q, k, v, g, beta, state, slot_ids, has_initial_state)
    if q.shape[0] != slot_ids.shape[0]:
        raise ValueError(f"a decode step has one token per sequence: {q.shape[0]} tokens, {slot_ids.shape[0]} slots")
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if q.shape[0] == 0:
        return out
    block_k, block_v = _dims(q, v)
    _gated_delta_decode_kernel[(q.shape[0], q.shape[1], cdiv(v.shape[-1], block_v))](
        q, k, v, g, beta, out, state, slot_ids, has_initial_state,
        q.shape[-1], v.shape[-1], q.shape[-1] ** -0.5, L2_EPS, *_strides(q, k, v, g, beta, out, state),
        BK=block_k, BV=block_v,
    )  # fmt: skip
    return out
