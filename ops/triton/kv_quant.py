"""Triton pieces of the block-quantized K/V rows (format, rounding and the tiles a cache keeps them in:
ops/kv_quant.py): the 32-point Hadamard rotation, quantizing blocks into row bytes (write_kv), where a row's
bytes lie in its tile (`tile_offset`, for write_kv and paged_attention) and dequantizing values as they are
loaded (paged_attention). FORMAT codes: 0 values as stored, 1 q8_0, 2 q4_0 (`FORMAT_CODES`)."""
from __future__ import annotations

import math

import triton
import triton.language as tl

FORMAT_CODES = {None: 0, "q8_0": 1, "q4_0": 2}
TILE = tl.constexpr(16)          # slots per tile (ops/kv_quant.py's TILE)
INV_SQRT_BLOCK = tl.constexpr(1 / math.sqrt(32))
_RNE = tl.constexpr(12582912.0)  # 1.5 * 2^23: (x + it) - it rounds |x| < 2^22 to the nearest integer, ties to even


@triton.jit
def _butterfly(x, R: tl.constexpr, H: tl.constexpr):
    """One stage over x [R, 32]: the pairs (j, j + H) of each 2H-value group -> (a + b, a - b)."""
    y = tl.permute(tl.reshape(x, [R, 32 // (2 * H), 2, H]), [0, 1, 3, 2])
    a, b = tl.split(y)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [R, 32])


@triton.jit
def rotate_blocks(x, R: tl.constexpr):
    """x [R, 32] fp32 times H / sqrt(32), row by row: the torch body's butterflies in its order."""
    x = _butterfly(x, R, 1)
    x = _butterfly(x, R, 2)
    x = _butterfly(x, R, 4)
    x = _butterfly(x, R, 8)
    x = _butterfly(x, R, 16)
    return x * INV_SQRT_BLOCK


@triton.jit
def quantize_blocks(x, R: tl.constexpr, FORMAT: tl.constexpr):
    """x [R, 32] fp32 -> (the fp16 scales' two bytes [R], [R]; the value bytes [R, 32] for q8_0 or [R, 16]
    for q4_0), uint8, rounded as the torch body rounds."""
    if FORMAT == 1:
        d = (tl.max(tl.abs(x), 1) / 127.0).to(tl.float16)
    else:
        i = tl.arange(0, 32)[None, :]
        first = tl.argmax(tl.abs(x), 1, tie_break_left=True)
        # -0.0 is the sum's neutral element: the picked value keeps its sign, a zero's too
        d = (tl.sum(tl.where(i == first[:, None], x, -0.0), 1) / -8.0).to(tl.float16)
    d32 = d.to(tl.float32)
    inv = tl.where(d32 == 0.0, 0.0, 1.0 / tl.where(d32 == 0.0, 1.0, d32))
    scaled = x * inv[:, None]
    if FORMAT == 1:
        q = tl.minimum(tl.maximum((scaled + _RNE) - _RNE, -127.0), 127.0)
        qs = q.to(tl.int32).to(tl.int8).to(tl.uint8, bitcast=True)
    else:
        nib = tl.minimum(tl.maximum(tl.floor(scaled + 8.5), 0.0), 15.0).to(tl.int32)
        low, high = tl.split(tl.permute(tl.reshape(nib, [R, 2, 16]), [0, 2, 1]))
        qs = (low | (high << 4)).to(tl.uint8)
    bits = d.to(tl.uint16, bitcast=True).to(tl.int32)
    return (bits & 0xFF).to(tl.uint8), (bits >> 8).to(tl.uint8), qs


@triton.jit
def tile_offset(b, u, j, BLOCKS: tl.constexpr, FORMAT: tl.constexpr, K: tl.constexpr):
    """Where value byte u of block b of slot j's row lies in its tile (q8_0: u = the block's value 0..31;
    q4_0: its nibble pair 0..15), in the K order or the V order; the scale's two bytes are at
    `scale_offset`. Mirrors ops/kv_quant.py's `positions`."""
    values = BLOCKS * TILE * 2
    if FORMAT == 1:
        d = b * 32 + u
        if K:
            return values + (d // 4) * 64 + j * 4 + d % 4
        return values + ((d // 16) * (TILE // 4) + j // 4) * 64 + (d % 16) * 4 + j % 4
    if K:
        return values + b * 256 + (u // 4) * 64 + j * 4 + u % 4
    return values + (b * (TILE // 4) + j // 4) * 64 + u * 4 + j % 4


@triton.jit
def scale_offset(b, j):
    return (b * TILE + j) * 2


@triton.jit
def load_values(ptr, row, d, mask):
    """Values d ([1, D]) of the cache rows at ptr + row ([R, 1] offsets in elements), as stored."""
    return tl.load(ptr + row + d, mask=mask, other=0.0)


@triton.jit
def load_quantized(ptr, tile, j, d, mask, BLOCKS: tl.constexpr, FORMAT: tl.constexpr, K: tl.constexpr):
    """Values d ([1, D]) of slots j ([R, 1]) of the tiles starting at ptr + tile ([R, 1] byte offsets),
    dequantized to fp32."""
    b = d // 32
    i = d % 32
    at = ptr + tile + scale_offset(b, j)
    low = tl.load(at, mask=mask, other=0).to(tl.uint16)
    high = tl.load(at + 1, mask=mask, other=0).to(tl.uint16)
    scale = (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)
    if FORMAT == 1:
        q = tl.load(ptr + tile + tile_offset(b, i, j, BLOCKS, FORMAT, K), mask=mask, other=0)
        q = q.to(tl.int8, bitcast=True).to(tl.float32)
    else:
        byte = tl.load(ptr + tile + tile_offset(b, i % 16, j, BLOCKS, FORMAT, K), mask=mask, other=0).to(tl.int32)
        q = (tl.where(i < 16, byte & 0x0F, byte >> 4) - 8).to(tl.float32)
    return q * scale
