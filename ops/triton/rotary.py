"""Triton `rotary`: neox-style rotation of q and k (full or partial) from a [P, rotary_dim] cos/sin table."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ops.triton._launch import launchable, pow2


@triton.jit
def _rotate_heads(x_ptr, out_ptr, stride_t, stride_h, stride_ot, stride_oh, t, cos, sin,
                  HEADS: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                  HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    h = tl.arange(0, H_PAD)[:, None]
    j = tl.arange(0, HALF_PAD)[None, :]
    rot_ok = (h < HEADS) & (j < HALF)
    src = x_ptr + t * stride_t + h * stride_h
    dst = out_ptr + t * stride_ot + h * stride_oh
    x1 = tl.load(src + j, mask=rot_ok, other=0.0)
    x2 = tl.load(src + HALF + j, mask=rot_ok, other=0.0)
    dtype = x1.dtype
    # each product and sum rounds to x's dtype, as torch's x * cos - x2 * sin does in bf16
    a1 = (x1.to(tl.float32) * cos).to(dtype).to(tl.float32)
    b1 = (x2.to(tl.float32) * sin).to(dtype).to(tl.float32)
    a2 = (x2.to(tl.float32) * cos).to(dtype).to(tl.float32)
    b2 = (x1.to(tl.float32) * sin).to(dtype).to(tl.float32)
    tl.store(dst + j, (a1 - b1).to(dtype), mask=rot_ok)
    tl.store(dst + HALF + j, (a2 + b2).to(dtype), mask=rot_ok)
    d = tl.arange(0, D_PAD)[None, :]
    tail_ok = (h < HEADS) & (d >= 2 * HALF) & (d < HEAD_DIM)          # partial rotary: the rest passes through
    tl.store(dst + d, tl.load(src + d, mask=tail_ok), mask=tail_ok)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_sin_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
                   stride_cs,
                   Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr, QH_PAD: tl.constexpr, KH_PAD: tl.constexpr,
                   HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    j = tl.arange(0, HALF_PAD)[None, :]
    # the fp32 table is cast to x's dtype first, as the torch op does
    cos = tl.load(cos_sin_ptr + pos * stride_cs + j, mask=j < HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + j, mask=j < HALF, other=0.0)
    cos = cos.to(q_ptr.dtype.element_ty).to(tl.float32)
    sin = sin.to(q_ptr.dtype.element_ty).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, t, cos, sin,
                  Q_HEADS, QH_PAD, HEAD_DIM, D_PAD, HALF, HALF_PAD)
    _rotate_heads(k_ptr, k_out_ptr, stride_kt, stride_kh, stride_kot, stride_koh, t, cos, sin,
                  K_HEADS, KH_PAD, HEAD_DIM, D_PAD, HALF, HALF_PAD)


def rotary(q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor, rotary_dim: int) -> tuple[Tensor, Tensor]:
    """Same contract as `pagedserve::rotary` (positions are not range-checked on the host: no sync)."""
    q, k, cos_sin = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, cos_sin))
    num_tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    half = rotary_dim // 2
    if num_tokens:
        launchable(_rotary_kernel)[(num_tokens,)](
            q, k, q_out, k_out, positions, cos_sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1),
            k_out.stride(0), k_out.stride(1), cos_sin.stride(0),
            Q_HEADS=q_heads, K_HEADS=k_heads, QH_PAD=pow2(q_heads), KH_PAD=pow2(k_heads),
            HEAD_DIM=head_dim, D_PAD=pow2(head_dim), HALF=half, HALF_PAD=pow2(half))
    return q_out, k_out
