"""Triton `gated_delta_rule`: Gated DeltaNet over a flat varlen batch, recurrent state by slot.

A program owns one row, one value head and a block of BLOCK_V value columns of that head's [Dk, Dv] fp32
state, which it keeps in registers from the row's first token to its last (columns of the state are
independent, so programs never share state memory). Per token, with q, k optionally L2-normalised and q
scaled by Dk^-0.5:  S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q.
A decode row (one token) takes that step once, and so does each token of a row that records checkpoints
(speculative verify rows, a few tokens: the state after each token is stored). Longer rows go CHUNK tokens
at a time in the chunked
(WY / UT-transform) form of `ops.gated_delta_rule._chunked`: the chunk's delta-rule updates form a unit
lower-triangular system; solving it once gives every token's corrected value, and the rest is matmuls.
The last chunk of a row is masked (k = beta = g = 0 past the row's end, which changes nothing).
Every product runs in fp32 (IEEE), since the state is fp32 and must match the per-token reference.
The row lengths are read in the kernel, never on the host, so the launch is CUDA-graph safe and traceable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ops.triton._launch import launchable, mma, pow2

_BLOCK_V = 32
CHUNK = 64                # tokens per step of a multi-token row (a power of two >= 16)
_MIN_DOT = 16             # tl.dot needs every dimension >= 16


@triton.jit
def _unit_rows(ptrs, mask, L2NORM: tl.constexpr):
    """q or k rows in fp32, L2-normalised like the fla kernels (rsqrt(sum sq + 1e-6)) when L2NORM."""
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if L2NORM:
        x = x * tl.rsqrt(tl.sum(x * x, 1, keep_dims=True) + 1e-6)
    return x


@triton.jit
def _gated_delta_rule_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, qsl_ptr, slot_ptr,
                             ckpt_ptr, ckpt_start_ptr, scale,
                             stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                             stride_gt, stride_bt, stride_ss, stride_sh, stride_sk, stride_ot, stride_oh,
                             stride_cks, stride_ckh, stride_ckk,
                             GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr,
                             BLOCK_V: tl.constexpr, CHUNK: tl.constexpr, L2NORM: tl.constexpr,
                             CHECKPOINTS: tl.constexpr):
    row = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot < 0:
        return
    start = tl.load(qsl_ptr + row).to(tl.int64)
    end = tl.load(qsl_ptr + row + 1).to(tl.int64)
    kd = tl.arange(0, DK_PAD)
    kd_ok = kd < DK
    vd = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    vd_ok = vd < DV
    s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + kd[:, None] * stride_sk + vd[None, :]
    s_ok = kd_ok[:, None] & vd_ok[None, :]
    state = tl.load(s_ptrs, mask=s_ok, other=0.0)
    # [1, D] pointers to this program's heads and columns; adding a column of token offsets gives a tile
    q_rows = q_ptr + (h // GROUP) * stride_qh + kd[None, :]
    k_rows = k_ptr + (h // GROUP) * stride_kh + kd[None, :]
    v_rows = v_ptr + h * stride_vh + vd[None, :]
    o_rows = out_ptr + h * stride_oh + vd[None, :]
    ckpt = tl.full([], -1, tl.int64)
    if CHECKPOINTS:
        ckpt = tl.load(ckpt_start_ptr + row).to(tl.int64)

    if (end - start == 1) | (ckpt >= 0):
        # a decode row, or a row recording its states: recurrent steps (a chunk would pad them to CHUNK)
        ck_ptrs = ckpt_ptr + ckpt * stride_cks + h * stride_ckh + kd[:, None] * stride_ckk + vd[None, :]
        for t in range(start, end):
            q = _unit_rows(q_rows + t * stride_qt, kd_ok[None, :], L2NORM) * scale
            k = tl.trans(_unit_rows(k_rows + t * stride_kt, kd_ok[None, :], L2NORM))     # [DK_PAD, 1]
            v = tl.load(v_rows + t * stride_vt, mask=vd_ok[None, :], other=0.0).to(tl.float32)
            beta = tl.load(beta_ptr + t * stride_bt + h).to(tl.float32)
            state = state * tl.exp(tl.load(g_ptr + t * stride_gt + h).to(tl.float32))
            state = state + k * (beta * (v - tl.sum(state * k, 0, keep_dims=True)))
            o = tl.sum(state * tl.trans(q), 0, keep_dims=True)
            tl.store(o_rows + t * stride_ot, o.to(out_ptr.dtype.element_ty), mask=vd_ok[None, :])
            if CHECKPOINTS:
                if ckpt >= 0:
                    tl.store(ck_ptrs + (t - start) * stride_cks, state, mask=s_ok)
    else:
        c = tl.arange(0, CHUNK)
        causal = c[:, None] >= c[None, :]
        eye = (c[:, None] == c[None, :]).to(tl.float32)
        for first in range(start, end, CHUNK):
            tok = first + c
            ok = tok < end
            qk_ok = ok[:, None] & kd_ok[None, :]
            q = _unit_rows(q_rows + tok[:, None] * stride_qt, qk_ok, L2NORM) * scale
            k = _unit_rows(k_rows + tok[:, None] * stride_kt, qk_ok, L2NORM)
            v = tl.load(v_rows + tok[:, None] * stride_vt, mask=ok[:, None] & vd_ok[None, :], other=0.0)
            v = v.to(tl.float32)
            beta = tl.load(beta_ptr + tok * stride_bt + h, mask=ok, other=0.0).to(tl.float32)
            decay = tl.cumsum(tl.load(g_ptr + tok * stride_gt + h, mask=ok, other=0.0).to(tl.float32), 0)
            # exp(decay_i - decay_j) for j <= i; masked before exp so the (positive) upper part cannot overflow
            pair = tl.exp(tl.where(causal, decay[:, None] - decay[None, :], float("-inf")))
            k_beta = k * beta[:, None]
            a = tl.where(c[:, None] > c[None, :], mma(k_beta, tl.trans(k), True) * pair, 0.0)
            # T = (I + A)^-1 by forward substitution: row r of T is e_r - A[r, :] T, and A[r, j >= r] = 0;
            # the rows of masked tokens are zero in A, so theirs stay e_r
            t = eye
            for r in range(1, tl.minimum(end - first, CHUNK)):
                is_r = c[:, None] == r
                a_r = tl.sum(tl.where(is_r, a, 0.0), 0)
                t = tl.where(is_r, eye - tl.sum(a_r[:, None] * t, 0)[None, :], t)
            values = mma(t, v * beta[:, None], True)
            state_keys = mma(t, k_beta * tl.exp(decay)[:, None], True)
            corrected = values - mma(state_keys, state, True)
            intra = mma(q, tl.trans(k), True) * pair
            o = mma(q * tl.exp(decay)[:, None], state, True) + mma(intra, corrected, True)
            tl.store(o_rows + tok[:, None] * stride_ot, o.to(out_ptr.dtype.element_ty),
                     mask=ok[:, None] & vd_ok[None, :])
            last = tl.sum(tl.where(c == CHUNK - 1, decay, 0.0), 0)            # g = 0 past the row's end
            k_to_end = k * tl.exp(last - decay)[:, None]
            state = state * tl.exp(last) + mma(tl.trans(k_to_end), corrected, True)
    tl.store(s_ptrs, state, mask=s_ok)


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor,
                     query_start_loc: Tensor, state_slots: Tensor, use_qk_l2norm: bool,
                     checkpoints: Tensor | None = None, checkpoint_start: Tensor | None = None, *,
                     chunk: int = CHUNK) -> Tensor:
    """Same contract as `pagedserve::gated_delta_rule` (mutates `state_pool` at the rows' slots). `chunk`
    (see CHUNK) only changes speed."""
    q, k, v, g, beta = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, g, beta))
    num_tokens, heads_k, dk = q.shape
    heads_v, dv = v.shape[1], v.shape[2]
    num_rows = state_slots.shape[0]
    out = torch.zeros_like(v)                                          # padding tokens and slot -1 rows: zeros
    if num_rows == 0 or num_tokens == 0:
        return out
    block_v = min(_BLOCK_V, pow2(dv, _MIN_DOT))
    record = checkpoints is not None
    ckpt = checkpoints if record else state_pool             # not read without CHECKPOINTS
    launchable(_gated_delta_rule_kernel)[(num_rows, heads_v, triton.cdiv(dv, block_v))](
        q, k, v, g, beta, state_pool, out, query_start_loc, state_slots, ckpt,
        checkpoint_start if record else state_slots, dk ** -0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        state_pool.stride(0), state_pool.stride(1), state_pool.stride(2), out.stride(0), out.stride(1),
        ckpt.stride(0), ckpt.stride(1), ckpt.stride(2),
        GROUP=heads_v // heads_k, DK=dk, DV=dv, DK_PAD=pow2(dk, _MIN_DOT), BLOCK_V=block_v, CHUNK=chunk,
        L2NORM=use_qk_l2norm, CHECKPOINTS=record)
    return out
