"""Block-quantized K/V cache formats, the one place that knows their bytes (ops, pool and tests use it).

A quantized cache is a `torch.uint8` tensor [NB, BS, Hk, row_bytes]: one row of bytes per (slot, kv head),
head_dim / 32 blocks of 32 values in llama.cpp's block layouts:
  q8_0: fp16 scale d, 32 int8 q (34 bytes); value = d * q, d = amax / 127.
  q4_0: fp16 scale d, 16 bytes of nibbles (18 bytes); byte j holds value j in its low nibble and value
        j + 16 in its high one; value = d * (nibble - 8), d = (the value of largest magnitude) / -8.
Both round the way the C++ write_kv kernel does (ops/cpu/kv_quant.h), so the two store the same bytes: the
scale is rounded to fp16 first and the values are multiplied by the reciprocal of that stored scale
(llama.cpp uses the unrounded one); q8_0 rounds half to even (llama.cpp's roundf: half away from zero), q4_0
takes floor(x / d + 8.5) clamped to [0, 15] as llama.cpp does.

K is stored rotated: each 32-value block is multiplied by the orthonormal Walsh-Hadamard matrix H/sqrt(32)
(symmetric, its own inverse) before it is quantized, which spreads an outlier over the block so the
per-block scale fits the rest. Attention rotates q's blocks the same way, so q.k is unchanged in exact
arithmetic. V is quantized as it is. The rotation cannot help where many of a block's values share one
large, nearly constant part (a k_proj bias): models subtract such a part from every key before write_kv,
which leaves attention unchanged (engine/models/qwen3.py).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

BLOCK = 32                                           # values per scale
BLOCK_BYTES = {"q8_0": 2 + BLOCK, "q4_0": 2 + BLOCK // 2}
FORMATS = tuple(BLOCK_BYTES)
_INV_SQRT_BLOCK = 1 / math.sqrt(BLOCK)               # rounded to fp32 where it is used


def row_bytes(fmt: str, head_dim: int) -> int:
    """Bytes of one (slot, kv head) row of `head_dim` values."""
    return head_dim // BLOCK * BLOCK_BYTES[fmt]


def head_dim_problem(fmt: str, head_dim: int) -> str | None:
    """Why `fmt` cannot store heads of `head_dim` values, or None."""
    if head_dim % BLOCK:
        return (f"kv_cache_dtype {fmt} needs head_dim a multiple of {BLOCK}; this model has {head_dim} "
                f"(use kv_cache_dtype bf16)")
    return None


def format_of(cache: Tensor, head_dim: int) -> str | None:
    """The quantized format of a uint8 `cache` holding heads of `head_dim` values (None: not one)."""
    if cache.dtype != torch.uint8 or head_dim % BLOCK:
        return None
    return next((f for f in FORMATS if cache.shape[-1] == row_bytes(f, head_dim)), None)


def rotate(x: Tensor) -> Tensor:
    """x (last dim a multiple of 32) in fp32 (fp64 stays fp64) with every 32-value block times H/sqrt(32):
    five butterfly stages of pairwise sums and differences, then one multiply, in the C++ kernel's order."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    y = x.to(dtype).reshape(-1, x.shape[-1] // BLOCK, BLOCK)
    h = 1
    while h < BLOCK:
        pairs = y.view(*y.shape[:-1], BLOCK // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).view_as(y)
        h *= 2
    return (y * torch.tensor(_INV_SQRT_BLOCK, dtype=dtype)).view(x.shape)


def quantize(x: Tensor, fmt: str) -> Tensor:
    """x [..., D] -> uint8 [..., row_bytes(fmt, D)], from x rounded to fp32."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    if fmt == "q8_0":
        d = (blocks.abs().amax(-1, keepdim=True) / 127).half()
    else:
        pick = blocks.abs().argmax(-1, keepdim=True)                   # the first of equal magnitudes
        d = (blocks.gather(-1, pick) / -8).half()
    d32 = d.float()
    inv = torch.where(d32 == 0, 0.0, 1 / d32)
    scaled = blocks * inv
    if fmt == "q8_0":
        qs = scaled.round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
    else:
        nib = (scaled + 8.5).floor().clamp(0, 15).to(torch.uint8)
        qs = nib[..., : BLOCK // 2] | (nib[..., BLOCK // 2:] << 4)
    out = torch.cat((d.view(torch.uint8), qs), dim=-1)
    return out.view(*x.shape[:-1], row_bytes(fmt, x.shape[-1]))


def dequantize(rows: Tensor, fmt: str) -> Tensor:
    """uint8 [..., row_bytes] -> fp32 [..., D]."""
    n = rows.shape[-1] // BLOCK_BYTES[fmt]
    blocks = rows.reshape(*rows.shape[:-1], n, BLOCK_BYTES[fmt])
    d = blocks[..., :2].contiguous().view(torch.float16).float()       # [..., n, 1]
    qs = blocks[..., 2:]
    if fmt == "q8_0":
        q = qs.contiguous().view(torch.int8).float()
    else:
        q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).float() - 8
    return (d * q).reshape(*rows.shape[:-1], n * BLOCK)


def quantize_kv(k: Tensor, v: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    """The cache rows of new keys (rotated, then quantized) and values (quantized)."""
    return quantize(rotate(k), fmt), quantize(v, fmt)


def dequantize_kv(k_rows: Tensor, v_rows: Tensor, fmt: str, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """K (still rotated: pair it with rotate(q)) and V from cache rows, in `dtype`."""
    return dequantize(k_rows, fmt).to(dtype), dequantize(v_rows, fmt).to(dtype)


def int8_queries(q: Tensor) -> Tensor:
    """What the C++ kernel's integer dot products score with on CPUs with AVX-512 VNNI
    (ops/cpu/attention_int8.h): q rounded to fp32, rotated, each 32-value block in steps d = amax / 127
    (round(x / d), half to even: a q8_0 block with an fp32 scale), rotated back; fp32 [..., D]. Pair it
    with K rotated back."""
    blocks = rotate(q.float()).reshape(*q.shape[:-1], q.shape[-1] // BLOCK, BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    return rotate(((blocks * torch.where(d == 0, 0.0, 1 / d)).round() * d).reshape(q.shape))
