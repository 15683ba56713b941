"""GGUF quantized blocks -> pagedserve's group form: integer values `q`, a scale and a min per 32 values.

The group form means w = scale * q + min (ops/quant_weight.py). Every block format whose sub-blocks
hold 32 values maps onto it with the format's own numbers, so the weights dequantize to exactly what
the `gguf` package's dequantizer gives (scale = d * sc is exact in fp32: an fp16 times a 6-bit int):

    Q4_0  d * (q - 8)              -> int4, scale d, min -8d
    Q4_1  d * q + m                -> int4, scale d, min m
    Q4_K  d*sc_j * q - dmin*m_j    -> int4 per 32-value sub-block j, two-level: sub-values sc_j and m_j
                                      under the super-block's d and -dmin (as the file stores them)
    Q5_0  d * (q - 16)             -> int8 values q - 16, scale d
    Q5_1                           -> int8 values 0..31 with the format's scale and min
    Q5_K                           -> int8 values 0..31, two-level like Q4_K
    Q8_0  d * q                    -> int8, scale d
    Q6_K  d*sc_j * (q - 32)        -> int6 as it is: 6-bit q, int8 sub-scale sc_j per 16 values, d per 256
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from ops.quant_weight import GROUP, HALF

QK_K = 256
INT4_TYPES = (T.Q4_0, T.Q4_1, T.Q4_K)
INT8_TYPES = (T.Q5_0, T.Q5_1, T.Q5_K, T.Q8_0)
KEPT_TYPES = INT4_TYPES + INT8_TYPES + (T.Q6_K,)


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes [n, c, h] -> values [n, c, 2h]: low nibbles first, then high ones (ggml's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Q5_0/Q5_1's 32 fifth bits, one per value, little-endian in 4 bytes -> [n, 32] of 0/16."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")[:, :count]
    return bits.astype(np.uint8) << 4


def _q4_0(b):
    d = _f16(b[:, :2])
    return _nibbles(b[:, None, 2:]).reshape(len(b), 32), d, -8 * d


def _q4_1(b):
    return _nibbles(b[:, None, 4:]).reshape(len(b), 32), _f16(b[:, :2]), _f16(b[:, 2:4])


def _k_scales(b):
    """Q4_K/Q5_K super-block header -> sub-scales sc and sub-mins m (uint8 [n, 8]) and the factors
    [n, 2]: d and -dmin (scale = d * sc, min = -dmin * m)."""
    sc, m = quants.Q4_K.get_scale_min(b[:, 4:16])
    supers = np.stack([_f16(b[:, :2])[:, 0], -_f16(b[:, 2:4])[:, 0]], axis=-1)
    return sc.astype(np.uint8), m.astype(np.uint8), supers


def _q4_k(b):
    q = _nibbles(b[:, 16:144].reshape(len(b), 4, 32))           # [n, 4 chunks, 64]
    return (q.reshape(len(b), QK_K),) + _k_scales(b)


def _q5_0(b):
    low = _nibbles(b[:, None, 6:]).reshape(len(b), 32)
    q = (low | _high_bits(b[:, 2:6], 32)).astype(np.int8) - np.int8(16)
    return q, _f16(b[:, :2]), None


def _q5_1(b):
    low = _nibbles(b[:, None, 8:]).reshape(len(b), 32)
    return (low | _high_bits(b[:, 4:8], 32)).astype(np.int8), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q5_k(b):
    low = _nibbles(b[:, 48:176].reshape(len(b), 4, 32)).reshape(len(b), 8, 32)
    high = (b[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1    # bit j of qh -> sub-block j
    return ((low | (high << 4)).astype(np.int8).reshape(len(b), QK_K),) + _k_scales(b)


def _q8_0(b):
    return b[:, 2:].view(np.int8), _f16(b[:, :2]), None


def _q6_k(b):
    """Per 128 values: ql's 64 bytes give low nibbles of values 0..63, high nibbles of 64..127; qh's 32
    bytes give the top two bits of values j, j+32, j+64 and j+96 at shifts 0, 2, 4 and 6."""
    n = len(b)
    low = (b[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8)[:, None]) & 0x0F
    high = (b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 0x03
    q = low.reshape(n, QK_K) | (high.reshape(n, QK_K) << 4)
    return q, b[:, 192:208].view(np.int8), None, _f16(b[:, 208:210])


_UNPACK = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q4_K: _q4_k, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q5_K: _q5_k,
           T.Q8_0: _q8_0, T.Q6_K: _q6_k}


def groups(data: np.ndarray, kind: T, shape: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """A GGUF tensor's raw bytes (`[rows, bytes per row]`, any of KEPT_TYPES) in group form for
    `QuantizedWeight.from_groups`: (q [N, K], scales, mins, supers). One-level types give float32
    scales and mins [N, K/32] (mins None when all zero) and supers None; Q4_K/Q5_K give uint8 sub-scales
    and sub-mins with float32 supers [N, K/256, 2]; Q6_K int8 sub-scales [N, K/16] and supers [N, K/256, 1]."""
    rows, cols = shape
    type_size = quants.GGML_QUANT_SIZES[kind][1]
    unpacked = _UNPACK[kind](np.ascontiguousarray(data).reshape(-1, type_size))
    q, scales, mins = unpacked[:3]
    supers = unpacked[3] if len(unpacked) == 4 else None

    def per_row(a: np.ndarray | None, count: int) -> torch.Tensor | None:
        """[rows, count] values, or [rows, count, S] where each has S parts (supers: scale and min)."""
        return None if a is None else torch.from_numpy(np.ascontiguousarray(a)).reshape(rows, count, -1)
    per = HALF if kind == T.Q6_K else GROUP
    return (per_row(q, cols)[..., 0], per_row(scales, cols // per)[..., 0],
            None if mins is None else per_row(mins, cols // GROUP)[..., 0],
            None if supers is None else per_row(supers, cols // QK_K))


def bits_of(kind: T) -> int:
    return 4 if kind in INT4_TYPES else 6 if kind == T.Q6_K else 8
