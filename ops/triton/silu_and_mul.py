"""Triton `silu_and_mul`: silu(gate) * up over [.., 2*I] rows, gate first."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ops.triton._launch import launchable, pow2

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, HALF: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < HALF
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + HALF + cols, mask=ok, other=0.0).to(tl.float32)
    # silu rounds to x's dtype before the product, like F.silu(gate) * up in torch
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(x: Tensor) -> Tensor:
    """Same contract as `pagedserve::silu_and_mul`."""
    half = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    out = torch.empty(rows.shape[0], half, dtype=x.dtype, device=x.device)
    block = min(_BLOCK, pow2(half))
    if rows.shape[0] and half:
        launchable(_silu_and_mul_kernel)[(rows.shape[0], triton.cdiv(half, block))](
            rows, out, rows.stride(0), out.stride(0), HALF=half, BLOCK=block)
    return out.view(*x.shape[:-1], half)
