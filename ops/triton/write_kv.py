"""Triton `write_kv`: one program per new token copies its [Hk, D] key and value rows into the paged cache,
converted to the cache's dtype."""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from ops.triton._launch import launchable, pow2


@triton.jit
def _write_kv_kernel(k_cache_ptr, v_cache_ptr, k_ptr, v_ptr, slot_ptr,
                     stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     PAGE: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     H_PAD: tl.constexpr, D_PAD: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return                                                         # padding token: touches nothing
    block = slot // PAGE
    offset = slot % PAGE
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    ok = (h < HEADS) & (d < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=ok)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=ok)
    tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kcs + h * stride_kch + d,
             k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vcs + h * stride_vch + d,
             v.to(v_cache_ptr.dtype.element_ty), mask=ok)


def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Same contract as `pagedserve::write_kv` (negative slots are skipped). Slots are not range-checked
    here: that would read them on the host and break CUDA graphs; the scheduler hands out valid ones."""
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    num_tokens, heads, head_dim = k.shape
    if num_tokens == 0:
        return
    launchable(_write_kv_kernel)[(num_tokens,)](
        k_cache, v_cache, k, v, slot_mapping,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        PAGE=k_cache.shape[1], HEADS=heads, HEAD_DIM=head_dim, H_PAD=pow2(heads), D_PAD=pow2(head_dim))
