"""Triton `rms_norm` and `add_rms_norm`: one program per row, fp32 statistics, rounding where HF rounds."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ops.triton._launch import launchable, pow2


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, eps, stride_x, stride_r, stride_o, stride_s,
                     N: tl.constexpr, BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if ADD_RESIDUAL:
        # residual + x rounds to x's dtype first, exactly like the torch sum the next layer receives
        x = (tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
             + x.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=ok)
    xf = x.to(tl.float32)
    normed = xf * tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    # cast back to x's dtype, THEN scale by the weight, as transformers does
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    out = w * normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def _launch(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor | None]:
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    res = summed = None
    if residual is not None:
        res = residual.reshape(-1, n)
        res = res if res.stride(-1) == 1 else res.contiguous()
        summed = torch.empty_like(rows)
    if rows.shape[0]:
        launchable(_rms_norm_kernel)[(rows.shape[0],)](
            rows, rows if res is None else res, weight, out, out if summed is None else summed, eps,
            rows.stride(0), 0 if res is None else res.stride(0), out.stride(0),
            0 if summed is None else summed.stride(0),
            N=n, BLOCK=pow2(n), ADD_RESIDUAL=residual is not None)
    return out.view(x.shape), None if summed is None else summed.view(x.shape)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Same contract as `pagedserve::rms_norm`."""
    return _launch(x, None, weight.contiguous(), eps)[0]


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Same contract as `pagedserve::add_rms_norm`: (rms_norm(residual + x), residual + x)."""
    out, summed = _launch(x, residual, weight.contiguous(), eps)
    return out, summed
