"""Triton `write_kv`: one program per new token copies its [Hk, D] key and value rows into the paged cache,
converted to the cache's dtype, or quantized into q8_0 / q4_0 rows (K rotated first) stored where the slot's
tile keeps them (ops/kv_quant.py)."""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from ops import kv_quant
from ops.triton._launch import launchable, pow2
from ops.triton.kv_quant import FORMAT_CODES, TILE, quantize_blocks, rotate_blocks, scale_offset, tile_offset


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


@triton.jit
def _quantize_rows(cache_ptr, x_ptr, t, block, offset, stride_cb, stride_xt, stride_xh, PAGE: tl.constexpr,
                   HEADS: tl.constexpr, BLOCKS: tl.constexpr, H_PAD: tl.constexpr, B_PAD: tl.constexpr,
                   FORMAT: tl.constexpr, K: tl.constexpr):
    """Token t's [HEADS, BLOCKS * 32] rows of x quantized into its slot's tiles; one tile row per block."""
    R: tl.constexpr = H_PAD * B_PAD
    r = tl.arange(0, R)
    h, b = r // B_PAD, r % B_PAD
    ok = (h < HEADS) & (b < BLOCKS)
    i = tl.arange(0, 32)[None, :]
    x = tl.load(x_ptr + t * stride_xt + h[:, None] * stride_xh + b[:, None] * 32 + i, mask=ok[:, None],
                other=0.0).to(tl.float32)
    if K:
        x = rotate_blocks(x, R)
    low, high, qs = quantize_blocks(x, R, FORMAT)
    tile_bytes = TILE * BLOCKS * (34 if FORMAT == 1 else 18)
    tile = cache_ptr + block * stride_cb + (h * (PAGE // TILE) + offset // TILE) * tile_bytes
    j = offset % TILE
    tl.store(tile + scale_offset(b, j), low, mask=ok)
    tl.store(tile + scale_offset(b, j) + 1, high, mask=ok)
    u = tl.arange(0, 32 if FORMAT == 1 else 16)[None, :]
    tl.store(tile[:, None] + tile_offset(b[:, None], u, j, BLOCKS, FORMAT, K), qs, mask=ok[:, None])


@triton.jit
def _write_kv_quant_kernel(k_cache_ptr, v_cache_ptr, k_ptr, v_ptr, slot_ptr, stride_cb,
                           stride_kt, stride_kh, stride_vt, stride_vh,
                           PAGE: tl.constexpr, HEADS: tl.constexpr, BLOCKS: tl.constexpr, H_PAD: tl.constexpr,
                           B_PAD: tl.constexpr, FORMAT: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    block = slot // PAGE
    offset = slot % PAGE
    _quantize_rows(k_cache_ptr, k_ptr, t, block, offset, stride_cb, stride_kt, stride_kh, PAGE,
                   HEADS, BLOCKS, H_PAD, B_PAD, FORMAT, True)
    _quantize_rows(v_cache_ptr, v_ptr, t, block, offset, stride_cb, stride_vt, stride_vh, PAGE,
                   HEADS, BLOCKS, H_PAD, B_PAD, FORMAT, False)


def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Same contract as `pagedserve::write_kv` (negative slots are skipped). Slots are not range-checked
    here: that would read them on the host and break CUDA graphs; the scheduler hands out valid ones."""
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    num_tokens, heads, head_dim = k.shape
    if num_tokens == 0:
        return
    fmt = kv_quant.format_of(k_cache, head_dim)
    if fmt:
        blocks = head_dim // kv_quant.BLOCK
        launchable(_write_kv_quant_kernel)[(num_tokens,)](     # (contiguous caches: op checks)
            k_cache, v_cache, k, v, slot_mapping, k_cache.stride(0), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            PAGE=k_cache.shape[1], HEADS=heads, BLOCKS=blocks, H_PAD=pow2(heads), B_PAD=pow2(blocks),
            FORMAT=FORMAT_CODES[fmt])
        return
    launchable(_write_kv_kernel)[(num_tokens,)](
        k_cache, v_cache, k, v, slot_mapping,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        PAGE=k_cache.shape[1], HEADS=heads, HEAD_DIM=head_dim, H_PAD=pow2(heads), D_PAD=pow2(head_dim))
