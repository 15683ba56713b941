"""Block-quantized K/V cache formats, the one place that knows their bytes (ops, pool and tests use it).

A (slot, kv head) row of head_dim values is head_dim / 32 blocks of 32 values in llama.cpp's block layouts:
  q8_0: fp16 scale d, 32 int8 q (34 bytes); value = d * q, d = amax / 127.
  q4_0: fp16 scale d, 16 bytes of nibbles (18 bytes); byte j holds value j in its low nibble and value
        j + 16 in its high one; value = d * (nibble - 8), d = (the value of largest magnitude) / -8.
Both round the way the C++ write_kv kernel does (ops/cpu/kv_quant.h), so the two store the same bytes: the
scale is rounded to fp16 first and the values are multiplied by the reciprocal of that stored scale
(llama.cpp uses the unrounded one); q8_0 rounds half to even (llama.cpp's roundf: half away from zero), q4_0
takes floor(x / d + 8.5) clamped to [0, 15] as llama.cpp does.

A quantized cache is a contiguous `torch.uint8` tensor [NB, BS, Hk, row_bytes] whose blocks hold their rows'
bytes rearranged (`positions` says where each byte goes) into tiles of TILE slots of one kv head, so that
the decode kernel finds 16 slots side by side in a vector's lanes and reads each tile as one run of memory:
  block: [kv head][BS / TILE tiles][tile: TILE x row_bytes bytes]
  tile:  the TILE slots' scales block by block, fp16 [head_dim / 32][TILE], then the values:
    K q8_0  [head_dim / 4][TILE slots][4 values]: 4 consecutive values of each slot side by side
    K q4_0  [head_dim / 32][4][TILE slots][4 bytes]: row r of a block: each slot's bytes 4r .. 4r + 3
    V q8_0  [head_dim / 16][TILE / 4][16 values][4 slots]: 16 consecutive values of 4 consecutive slots
    V q4_0  [head_dim / 32][TILE / 4][16 bytes][4 slots]: a block's 16 bytes of 4 consecutive slots
The K order serves scores (a slot per lane, 4 values per dot product), the V order the weighted sum (a value
per lane, 4 slots per dot product). `arrange` and `rows_of` convert between rows and blocks; the block size
must be a multiple of TILE.

K is stored rotated: each 32-value block is multiplied by the orthonormal Walsh-Hadamard matrix H/sqrt(32)
(symmetric, its own inverse) before it is quantized, which spreads an outlier over the block so the
per-block scale fits the rest. Attention rotates q's blocks the same way, so q.k is unchanged in exact
arithmetic. V is quantized as it is. The rotation cannot help where many of a block's values share one
large, nearly constant part (a k_proj bias): models subtract such a part from every key before write_kv,
which leaves attention unchanged (engine/models/qwen3.py).
"""
from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

BLOCK = 32                                           # values per scale
BLOCK_BYTES = {"q8_0": 2 + BLOCK, "q4_0": 2 + BLOCK // 2}
FORMATS = tuple(BLOCK_BYTES)
ROLES = ("k", "v")                                   # the cache a row belongs to: their tiles differ
TILE = 16                                            # slots per tile
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


def block_size_problem(fmt: str, block_size: int) -> str | None:
    """Why `fmt` cannot be stored in blocks of `block_size` slots, or None."""
    if block_size % TILE:
        return (f"kv_cache_dtype {fmt} needs block_size a multiple of {TILE} (its tiles of {TILE} slots); "
                f"got {block_size}")
    return None


def format_of(cache: Tensor, head_dim: int) -> str | None:
    """The quantized format of a uint8 `cache` holding heads of `head_dim` values (None: not one)."""
    if cache.dtype != torch.uint8 or head_dim % BLOCK:
        return None
    return next((f for f in FORMATS if cache.shape[-1] == row_bytes(f, head_dim)), None)


@functools.lru_cache(maxsize=64)
def positions(fmt: str, role: str, block_size: int, kv_heads: int, head_dim: int) -> Tensor:
    """int64 [BS, Hk, row_bytes]: where byte i of the row of (slot, kv head) lies in its block's bytes (see
    the module docstring). Shared and cached: do not modify."""
    row, blocks = row_bytes(fmt, head_dim), head_dim // BLOCK
    s = torch.arange(block_size).view(-1, 1, 1)
    h = torch.arange(kv_heads).view(1, -1, 1)
    i = torch.arange(row).view(1, 1, -1)
    tile, j = s // TILE, s % TILE
    b, o = i // BLOCK_BYTES[fmt], i % BLOCK_BYTES[fmt]
    base = (h * (block_size // TILE) + tile) * (TILE * row)
    scale = base + (b * TILE + j) * 2 + o
    u, values = o - 2, base + blocks * TILE * 2
    # values in rows of 64 bytes (TILE 32-bit words): K row = 4 values of each slot, V row = 16 values of 4 slots
    if fmt == "q8_0":
        d = b * BLOCK + u
        value = (values + (d // 4) * 64 + j * 4 + d % 4 if role == "k"
                 else values + ((d // 16) * (TILE // 4) + j // 4) * 64 + d % 16 * 4 + j % 4)
    else:
        value = (values + (b * 4 + u // 4) * 64 + j * 4 + u % 4 if role == "k"
                 else values + (b * (TILE // 4) + j // 4) * 64 + u * 4 + j % 4)
    return torch.where(o < 2, scale, value).expand(block_size, kv_heads, row).contiguous()


def arrange(rows: Tensor, fmt: str, role: str) -> Tensor:
    """Rows uint8 [n, BS, Hk, row_bytes] -> the n blocks' bytes as the cache stores them (same shape)."""
    n = rows.shape[0]
    where = positions(fmt, role, *rows.shape[1:3], _head_dim(fmt, rows.shape[-1]))
    out = torch.empty(n, rows[0].numel(), dtype=torch.uint8)
    out[:, where.flatten()] = rows.reshape(n, -1)
    return out.view(rows.shape)


def rows_of(blocks: Tensor, fmt: str, role: str) -> Tensor:
    """Blocks of a cache uint8 [n, BS, Hk, row_bytes] -> their (slot, kv head) rows (same shape)."""
    where = positions(fmt, role, *blocks.shape[1:3], _head_dim(fmt, blocks.shape[-1]))
    return blocks.reshape(blocks.shape[0], -1)[:, where.flatten()].view(blocks.shape)


def _head_dim(fmt: str, row: int) -> int:
    return row // BLOCK_BYTES[fmt] * BLOCK


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


def dequantize_kv(k_blocks: Tensor, v_blocks: Tensor, fmt: str, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """K (still rotated: pair it with rotate(q)) and V [n, BS, Hk, D] from n blocks of the caches, in `dtype`."""
    return (dequantize(rows_of(k_blocks, fmt, "k"), fmt).to(dtype),
            dequantize(rows_of(v_blocks, fmt, "v"), fmt).to(dtype))


def write_rows(cache: Tensor, blocks: Tensor, offsets: Tensor, rows: Tensor, fmt: str, role: str) -> None:
    """Stores rows uint8 [T, Hk, row_bytes] as the rows of slots `offsets` of cache blocks `blocks` ([T] each)."""
    where = positions(fmt, role, *cache.shape[1:3], _head_dim(fmt, cache.shape[-1]))
    cache.view(cache.shape[0], -1).index_put_((blocks.view(-1, 1, 1), where[offsets]), rows)


def int8_queries(q: Tensor) -> Tensor:
    """What the C++ kernel's integer dot products score with on CPUs with AVX-512 VNNI
    (ops/cpu/attention_int8.h): q rounded to fp32, rotated, each 32-value block in steps d = amax / 127
    (round(x / d), half to even: a q8_0 block with an fp32 scale), rotated back; fp32 [..., D]. Pair it
    with K rotated back."""
    blocks = rotate(q.float()).reshape(*q.shape[:-1], q.shape[-1] // BLOCK, BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    return rotate(((blocks * torch.where(d == 0, 0.0, 1 / d)).round() * d).reshape(q.shape))
