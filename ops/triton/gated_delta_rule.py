"""Triton `gated_delta_rule`: Gated DeltaNet over a flat varlen batch, recurrent state by slot.

A program owns one row, one value head and a block of BLOCK_V value columns of that head's [Dk, Dv] fp32
state, which it keeps in registers while it walks the row's tokens in order:
S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q  (q, k optionally L2-normalised, q scaled by Dk^-0.5).
Decode rows take one step; prefill chunks continue from the slot's state and leave theirs behind, so a
prompt split over steps gives the same result. Columns of the state are independent, so programs never
share state memory.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ops.triton._launch import launchable, pow2

_BLOCK_V = 32


@triton.jit
def _gated_delta_rule_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, qsl_ptr, slot_ptr, scale,
                             stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                             stride_gt, stride_bt, stride_ss, stride_sh, stride_sk, stride_ot, stride_oh,
                             GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr,
                             BLOCK_V: tl.constexpr, L2NORM: tl.constexpr):
    row = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot < 0:
        return
    start = tl.load(qsl_ptr + row).to(tl.int64)
    end = tl.load(qsl_ptr + row + 1).to(tl.int64)
    hk = h // GROUP
    kd = tl.arange(0, DK_PAD)
    kd_ok = kd < DK
    vd = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    vd_ok = vd < DV
    s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + kd[:, None] * stride_sk + vd[None, :]
    s_ok = kd_ok[:, None] & vd_ok[None, :]
    state = tl.load(s_ptrs, mask=s_ok, other=0.0)
    for t in range(start, end):
        q = tl.load(q_ptr + t * stride_qt + hk * stride_qh + kd, mask=kd_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * stride_kt + hk * stride_kh + kd, mask=kd_ok, other=0.0).to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6)
            k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        q = q * scale
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + vd, mask=vd_ok, other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(g_ptr + t * stride_gt + h).to(tl.float32))
        beta = tl.load(beta_ptr + t * stride_bt + h).to(tl.float32)
        state = state * decay
        delta = beta * (v - tl.sum(state * k[:, None], 0))
        state = state + k[:, None] * delta[None, :]
        o = tl.sum(state * q[:, None], 0)
        tl.store(out_ptr + t * stride_ot + h * stride_oh + vd, o.to(out_ptr.dtype.element_ty), mask=vd_ok)
    tl.store(s_ptrs, state, mask=s_ok)


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor,
                     query_start_loc: Tensor, state_slots: Tensor, use_qk_l2norm: bool) -> Tensor:
    """Same contract as `pagedserve::gated_delta_rule` (mutates `state_pool` at the rows' slots)."""
    q, k, v, g, beta = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, g, beta))
    num_tokens, heads_k, dk = q.shape
    heads_v, dv = v.shape[1], v.shape[2]
    num_rows = state_slots.shape[0]
    out = torch.zeros_like(v)                                          # padding tokens and slot -1 rows: zeros
    if num_rows == 0 or num_tokens == 0:
        return out
    block_v = min(_BLOCK_V, pow2(dv))
    launchable(_gated_delta_rule_kernel)[(num_rows, heads_v, triton.cdiv(dv, block_v))](
        q, k, v, g, beta, state_pool, out, query_start_loc, state_slots, dk ** -0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        state_pool.stride(0), state_pool.stride(1), state_pool.stride(2), out.stride(0), out.stride(1),
        GROUP=heads_v // heads_k, DK=dk, DV=dv, DK_PAD=pow2(dk), BLOCK_V=block_v, L2NORM=use_qk_l2norm)
    return out
