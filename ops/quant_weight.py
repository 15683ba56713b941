"""A quantized linear weight as `pagedserve::quant_linear` (ops/quant_linear.py) reads it: 4-, 6- or
8-bit integers in groups of 32 along K, the layout below, and the quantizers that make one.

Meaning of a weight: w[n, k] = scales[n, k // 32] * q[n, k] + mins[n, k // 32] (mins absent = 0);
int4 q in 0..15, int8 q in -128..127. int6 is llama.cpp's Q6_K kept as it is: q in 0..63 stands for
q - 32, and each 16 values have their own int8 sub-scale under a super per 256 (see below).

Kernel layout (what `QuantizedWeight` holds). Output rows are padded to tiles of 8 (ROW_TILE);
T = ceil(N / 8) tiles, G = K / 32 groups:
    int8: qweight int8  [T, G, 256]: the tile's 8 rows of one group, 32 bytes each, rows in order.
    int4: qweight uint8 [T, G, 128]: four 32-byte vectors, k-interleaved: in vector p, bytes 4i..4i+3
          hold row i's q[k=8p..8p+3] in their low nibbles and q[k=8p+4..8p+7] in their high ones. The
          kernel's byte products with 4 x values broadcast then sum to each row's total in that row's
          own 32-bit lane, with no horizontal adds.
    scales, mins: float32 [T, G, 8]: the 8 rows' values of a group are one vector load.
    int6: qweight uint8 [T, G, 192]: bytes 0..127 are the low nibbles in the int4 layout (vectors 0 and 1
          hold the first 16-value half, 2 and 3 the second); bytes 128..191 hold the top two bits as
          two 32-byte vectors, H0 for vectors 0 and 1 and H1 for vectors 2 and 3: bits 0-1 of a byte
          belong to the value in the low nibble of the same byte position in the first of those
          vectors, bits 2-3 to its high nibble, bits 4-5 and 6-7 to the second vector's low and high
          nibble. One shift and mask then puts them above a nibble.
Padding rows have q = 0, scale = 0, min = 0.

Two-level scales (the form of llama.cpp's K-quants): scales and mins are uint8 [T, G, 8] sub-values and
`supers` float32 [T, ceil(G/8), S, 8] multiplies them per 8 groups (256 values; where K is no multiple
of 256 the last one covers the groups left): scale = supers[t, g // 8, 0] * scales[t, g],
min = supers[t, g // 8, 1] * mins[t, g] (S = 2 with mins, else 1), each product rounded to fp32 once
(exact for a GGUF file's fp16 supers). An int4 tile-group then takes 152 bytes instead of 192: 15 % less
memory for the default model, though no faster on an AVX2 CPU, where the kernel is close to compute-bound
at one row.

int6 scales are always two-level: `scales` int8 [T, G, 8, 2] holds each row's sub-scales of the group's
two 16-value halves, `supers` float32 [T, G/8, 1, 8] the d per 256 values, mins are absent, and
    w[n, k] = supers[n, k // 256] * scales[n, k // 16] * (q[n, k] - 32)
(exact in fp32: an fp16 times a 7-bit and a 5-bit integer). A tile-group takes 212 bytes, Q6_K's 210
per 256 values; the int8 form that Q6_K would otherwise need takes 268 and rounds each weight again.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from engine.errors import UserError

GROUP = 32                  # values per quantization group along K
ROW_TILE = 8                # output rows the kernel computes together; N is padded to a multiple
GROUP_BYTES = {4: ROW_TILE * GROUP // 2, 6: ROW_TILE * GROUP * 6 // 8, 8: ROW_TILE * GROUP}
Q_DTYPE = {4: torch.uint8, 6: torch.uint8, 8: torch.int8}
_Q_RANGE = {4: (0, 15), 6: (0, 63), 8: (-128, 127)}
SUPER = 8                   # groups sharing one super value in two-level scales (256 values, QK_K)
HALF = GROUP // 2           # values per int6 sub-scale
INT6_OFFSET = 32            # an int6 q stands for q - 32


class QuantError(UserError, ValueError):
    """Quantized weights that cannot be built or used; the message names the value and what is allowed."""


def _interleave(rows: Tensor, width: int) -> Tensor:
    """[T, G, 8, 32] values below 2**width -> [T, G, 4, 32] bytes of the int4 layout: vector p, byte
    4i + j holds row i's values k = 8p + j and 8p + 4 + j (the second shifted by `width`)."""
    tiles, groups = rows.shape[:2]
    quads = rows.view(tiles, groups, ROW_TILE, 4, 2, 4).permute(0, 1, 3, 2, 4, 5)    # [T, G, p, i, 2, j]
    return (quads[..., 0, :] | (quads[..., 1, :] << width)).reshape(tiles, groups, 4, 32)


def _deinterleave(packed: Tensor, width: int) -> Tensor:
    """Inverse of _interleave."""
    tiles, groups = packed.shape[:2]
    quads = packed.reshape(tiles, groups, 4, ROW_TILE, 1, 4)
    both = torch.cat([quads & ((1 << width) - 1), quads >> width], dim=4)            # [T, G, p, i, 2, j]
    return both.permute(0, 1, 3, 2, 4, 5).reshape(tiles, groups, ROW_TILE, GROUP)


def _pack(q: Tensor, bits: int) -> Tensor:
    """[Np, K] integers (Np a multiple of 8) -> kernel layout [T, G, bytes per tile-group]."""
    tiles, groups = q.shape[0] // ROW_TILE, q.shape[1] // GROUP
    rows = q.view(tiles, ROW_TILE, groups, GROUP).permute(0, 2, 1, 3)       # [T, G, 8, 32]
    if bits == 8:
        return rows.contiguous().view(tiles, groups, GROUP_BYTES[8])
    packed = _interleave(rows & 0x0F, 4).reshape(tiles, groups, 128)
    if bits == 6:
        codes = _interleave(rows >> 4, 2).view(tiles, groups, 2, 2, 32)   # [T, G, H0/H1, vector, 32]
        high = codes[:, :, :, 0] | (codes[:, :, :, 1] << 4)
        packed = torch.cat([packed, high.reshape(tiles, groups, 64)], dim=-1)
    return packed.contiguous()


def _unpack(qweight: Tensor, bits: int) -> Tensor:
    """Kernel layout -> [Np, K] integers (exact inverse of _pack)."""
    tiles, groups = qweight.shape[:2]
    if bits == 8:
        rows = qweight.view(tiles, groups, ROW_TILE, GROUP)
    else:
        rows = _deinterleave(qweight[..., :128], 4)
        if bits == 6:
            high = qweight[..., 128:].reshape(tiles, groups, 2, 1, 32)
            codes = torch.cat([high & 0x0F, high >> 4], dim=3).reshape(tiles, groups, 4, 32)
            rows = rows | (_deinterleave(codes, 2) << 4)
    return rows.permute(0, 2, 1, 3).reshape(tiles * ROW_TILE, groups * GROUP)


def _tile_per_group(values: Tensor) -> Tensor:
    """[Np, G, ...] -> [T, G, 8, ...]."""
    return values.view(-1, ROW_TILE, *values.shape[1:]).transpose(1, 2).contiguous()


def _untile_per_group(values: Tensor) -> Tensor:
    """[T, G, 8, ...] -> [Np, G, ...]."""
    return values.transpose(1, 2).reshape(-1, values.shape[1], *values.shape[3:])


def supers_per_row(groups: int) -> int:
    """Super values per row and factor kind: one per SUPER groups, the last one for what is left."""
    return -(-groups // SUPER)


def _per_group(supers: Tensor, groups: int) -> Tensor:
    """Supers [X, ceil(G/8), ...] -> each group's own [X, G, ...]."""
    return supers.repeat_interleave(SUPER, dim=1)[:, :groups]


def _tile_supers(supers: Tensor) -> Tensor:
    """[Np, G/8, S] -> [T, G/8, S, 8] (G/8 rounded up, as everywhere below)."""
    n, g8, s = supers.shape
    return supers.view(n // ROW_TILE, ROW_TILE, g8, s).permute(0, 2, 3, 1).contiguous()


def _untile_supers(supers: Tensor) -> Tensor:
    """[T, G/8, S, 8] -> [Np, G/8, S]."""
    t, g8, s, _ = supers.shape
    return supers.permute(0, 3, 1, 2).reshape(t * ROW_TILE, g8, s)


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A [N, K] weight in the kernel layout described in this module's docstring."""
    bits: int
    out_features: int
    in_features: int
    qweight: Tensor
    scales: Tensor
    mins: Tensor | None
    supers: Tensor | None = None     # two-level scales: scales and mins are uint8 (int6: int8) sub-values

    @classmethod
    def from_groups(cls, q: Tensor, scales: Tensor, mins: Tensor | None, bits: int,
                    supers: Tensor | None = None) -> QuantizedWeight:
        """q: [N, K] (bits=4: uint8 0..15; bits=8: int8); scales, mins: float32 [N, K // 32]; or, with
        `supers` float32 [N, ceil(K / 256), S] (S = 2 with mins, else 1), scales and mins uint8 sub-values.
        bits=6: q uint8 0..63 (standing for q - 32), scales int8 [N, K // 16], no mins, supers [N, K // 256, 1]."""
        if bits not in Q_DTYPE:
            raise QuantError(f"bits={bits}: allowed are 4, 6 and 8")
        if q.dim() != 2 or q.dtype != Q_DTYPE[bits]:
            raise QuantError(f"q must be a 2-D {Q_DTYPE[bits]} tensor for bits={bits}, "
                             f"got {q.dtype} {tuple(q.shape)}")
        n, k = q.shape
        if n == 0 or k == 0 or k % GROUP:
            raise QuantError(f"q is [{n}, {k}]: out_features must be > 0 and in_features a positive "
                             f"multiple of {GROUP}")
        low, high = _Q_RANGE[bits]
        if bits != 8 and int(q.max()) > high:
            raise QuantError(f"bits={bits} q values must lie in {low}..{high}, got a maximum of {int(q.max())}")
        groups = k // GROUP
        if bits == 6 and (supers is None or mins is not None):
            raise QuantError(f"bits=6 (Q6_K's form) takes int8 sub-scales per {HALF} values under supers "
                             f"and no mins; got {'no supers' if supers is None else 'mins'}")
        if bits == 6 and groups % SUPER:
            raise QuantError(f"bits=6 (Q6_K's form) needs in_features a multiple of {GROUP * SUPER}, got {k}")
        if supers is not None:
            count, per_row = 1 + (mins is not None), supers_per_row(groups)
            if supers.dtype != torch.float32 or tuple(supers.shape) != (n, per_row, count):
                raise QuantError(f"supers must be float32 [{n}, {per_row}, {count}] (one scale"
                                 f"{' and one min' if count == 2 else ''} factor per row and {GROUP * SUPER} "
                                 f"values, the last for the rest), got {supers.dtype} {tuple(supers.shape)} for K={k}")
        factor_dtype = torch.float32 if supers is None else torch.int8 if bits == 6 else torch.uint8
        per = HALF if bits == 6 else GROUP
        for name, t in (("scales", scales), ("mins", mins)):
            if t is not None and (t.dtype != factor_dtype or tuple(t.shape) != (n, k // per)):
                raise QuantError(f"{name} must be {factor_dtype} [{n}, {k // per}] (one per row and "
                                 f"{per} values{' under supers' if supers is not None else ''}), "
                                 f"got {t.dtype} {tuple(t.shape)}")
        pad = -n % ROW_TILE

        def rows_padded(t: Tensor) -> Tensor:
            return torch.nn.functional.pad(t.cpu(), (0, 0) * (t.dim() - 1) + (0, pad))
        if bits == 6:
            scales = scales.reshape(n, groups, GROUP // HALF)    # a group's two halves stay side by side
        tiled = [None if t is None else _tile_per_group(rows_padded(t)) for t in (scales, mins)]
        return cls(bits, n, k, _pack(rows_padded(q), bits), tiled[0], tiled[1],
                   None if supers is None else _tile_supers(rows_padded(supers)))

    def to_groups(self) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """(q, scales, mins, supers) as given to from_groups."""
        n = self.out_features
        q = _unpack(self.qweight, self.bits)[:n]
        mins = None if self.mins is None else _untile_per_group(self.mins)[:n].contiguous()
        supers = None if self.supers is None else _untile_supers(self.supers)[:n].contiguous()
        scales = _untile_per_group(self.scales)[:n].reshape(n, -1)
        return q.contiguous(), scales.contiguous(), mins, supers

    def flat_groups(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """(q, scales, mins) with float32 scales and mins per group: two-level ones multiplied out."""
        return self.flattened().to_groups()[:3]

    def flattened(self) -> QuantizedWeight:
        """The same weight with float32 scales (and mins) per group."""
        if self.bits == 6:
            raise QuantError(f"int6 has a scale per {HALF} values: it has no form with one per {GROUP}")
        if self.supers is None:
            return self
        per_group = _per_group(self.supers, self.in_features // GROUP)          # [T, G, S, 8]
        mins = None if self.mins is None else (per_group[:, :, 1] * self.mins.float()).contiguous()
        return replace(self, scales=(per_group[:, :, 0] * self.scales.float()).contiguous(), mins=mins, supers=None)

    def with_zero_mins(self) -> QuantizedWeight:
        """The same weight with explicit mins (zeros where it had none): what a fused asymmetric part needs."""
        if self.mins is not None:
            return self
        supers = None if self.supers is None else torch.cat([self.supers, torch.zeros_like(self.supers)], dim=2)
        return replace(self, mins=torch.zeros_like(self.scales), supers=supers)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """[N, K] weights from the formula: exact in float64; otherwise evaluated in float32 (one rounding
        per product and per added min), then cast to `dtype`."""
        work = torch.float64 if dtype == torch.float64 else torch.float32
        if self.bits == 6:
            q, scales, _, supers = self.to_groups()
            w = (q.to(work) - INT6_OFFSET).view(q.shape[0], -1, HALF) * scales.to(work)[..., None]
            return (w.view(q.shape[0], -1, GROUP * SUPER) * supers.to(work)).view(q.shape).to(dtype)
        q, scales, mins = self.flat_groups()
        w = q.to(work).view(q.shape[0], -1, GROUP) * scales.to(work)[..., None]
        if mins is not None:
            w = w + mins.to(work)[..., None]
        return w.view(q.shape).to(dtype)

    def rows(self, ids: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """Rows `ids` of `dequantize(dtype)`, [len(ids), K], unpacking only their tiles: an embedding
        lookup in a table kept quantized."""
        tiles = ids // ROW_TILE

        def picked(t: Tensor | None) -> Tensor | None:     # index_select: 10 us a call here, indexing 49
            return None if t is None else t.index_select(0, tiles)
        part = replace(self, out_features=len(ids) * ROW_TILE, qweight=picked(self.qweight),
                       scales=picked(self.scales), mins=picked(self.mins), supers=picked(self.supers))
        at = torch.arange(0, len(ids) * ROW_TILE, ROW_TILE) + ids % ROW_TILE
        return part.dequantize(dtype).index_select(0, at)

    def with_bits(self, bits: int) -> QuantizedWeight:
        """The same weight stored as int8: int4 values 0..15 fit as they are, with the same scales."""
        if bits == self.bits:
            return self
        if (self.bits, bits) != (4, 8):
            raise QuantError(f"int{self.bits} -> int{bits} would lose precision; only int4 -> int8 is lossless")
        q, scales, mins, supers = self.to_groups()
        return QuantizedWeight.from_groups(q.to(torch.int8), scales, mins, 8, supers)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """The weights stacked along N (e.g. q, k and v projections into one). Parts without mins
        get zero mins when another part has them; scales stay two-level only when every part's are."""
        if not parts:
            raise QuantError("QuantizedWeight.cat needs at least one part")
        first = parts[0]
        for p in parts:
            if (p.bits, p.in_features) != (first.bits, first.in_features):
                raise QuantError(f"QuantizedWeight.cat parts must share bits and in_features: got "
                                 f"{first.describe()} K={first.in_features} and {p.describe()} K={p.in_features}")
        if not all(p.supers is not None for p in parts):
            parts = [p.flattened() for p in parts]
        if any(p.mins is not None for p in parts):
            parts = [p.with_zero_mins() for p in parts]
        if all(p.out_features % ROW_TILE == 0 for p in parts[:-1]):
            # no padding rows inside the result: the tiles stack as they are
            def stacked(field: str) -> Tensor | None:
                values = [getattr(p, field) for p in parts]
                return None if values[0] is None else torch.cat(values)
            return replace(first, out_features=sum(p.out_features for p in parts), qweight=stacked("qweight"),
                           scales=stacked("scales"), mins=stacked("mins"), supers=stacked("supers"))
        groups = [p.to_groups() for p in parts]
        joined = [None if groups[0][i] is None else torch.cat([g[i] for g in groups]) for i in range(4)]
        return QuantizedWeight.from_groups(joined[0], joined[1], joined[2], first.bits, joined[3])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.mins, self.supers)
                   if t is not None)

    def describe(self) -> str:
        scales = "g16x16" if self.bits == 6 else "g32x8" if self.supers is not None else "g32"
        return f"int{self.bits} {scales} {'sym' if self.mins is None else 'asym'}"


def _weight_groups(w: Tensor, group_size: int) -> Tensor:
    """[N, K] float -> float32 [N, K // group_size, group_size], validated."""
    if group_size <= 0 or group_size % GROUP:
        raise QuantError(f"group_size={group_size}: must be a positive multiple of {GROUP}")
    if w.dim() != 2 or not w.is_floating_point() or w.shape[1] % group_size:
        raise QuantError(f"w must be a 2-D float [N, K] tensor with K a multiple of group_size={group_size}, "
                         f"got {w.dtype} {tuple(w.shape)}")
    return w.detach().cpu().float().view(w.shape[0], -1, group_size)


def _per_group32(values: Tensor, group_size: int) -> Tensor:
    """[N, K // group_size] -> [N, K // 32]: a larger group's value repeated for each 32 it spans."""
    return values.repeat_interleave(group_size // GROUP, dim=1).contiguous()


def _two_level(values: Tensor) -> tuple[Tensor, Tensor]:
    """Magnitudes >= 0 per group [N, G] -> (uint8 sub-values [N, G], float32 supers [N, ceil(G/8)]) with
    supers * sub >= value, rounded up so that a quantized group's range still covers its weights."""
    n, groups = values.shape
    per_super = torch.nn.functional.pad(values, (0, -groups % SUPER)).view(n, -1, SUPER)
    supers = per_super.amax(-1) / 255
    safe = torch.where(supers > 0, supers, 1.0)[..., None]
    subs = torch.ceil(per_super / safe).clamp(0, 255).to(torch.uint8)
    return subs.view(n, -1)[:, :groups].contiguous(), supers


def _expand(subs: Tensor, supers: Tensor) -> Tensor:
    """The fp32 factors two-level (subs, supers) stand for, [N, G] (as QuantizedWeight multiplies them)."""
    return _per_group(supers, subs.shape[1]) * subs.float()


def quantize_int8(w: Tensor, group_size: int = GROUP) -> QuantizedWeight:
    """Symmetric: scale = amax / 127 per group, q = round(w / scale), no mins. The scales are two-level
    (each rounded up to a multiple of its super-block's max / 255)."""
    groups = _weight_groups(w, group_size)
    scales = _per_group32(groups.abs().amax(-1) / 127, group_size)
    subs, supers = _two_level(scales)
    scales, supers = _expand(subs, supers), supers[..., None]
    safe = torch.where(scales > 0, scales, 1.0).view(w.shape[0], -1, 1)
    q = torch.round(w.detach().cpu().float().view(w.shape[0], -1, GROUP) / safe).clamp(-127, 127)
    q = q.to(torch.int8).view(w.shape)
    return QuantizedWeight.from_groups(q, subs, None, 8, supers)


def quantize_int4(w: Tensor, group_size: int = GROUP) -> QuantizedWeight:
    """Asymmetric: per group min and scale = (max - min) / 15, q = round((w - min) / scale) in 0..15.
    The factors are two-level like llama.cpp's Q4_K: mins are <= 0 (a group above zero starts at 0) and
    rounded away from zero, then scales are rounded up to still reach the max."""
    groups = _weight_groups(w, group_size)
    low, high = _per_group32(groups.amin(-1), group_size), _per_group32(groups.amax(-1), group_size)
    min_subs, min_supers = _two_level(-low.clamp(max=0))
    low = -_expand(min_subs, min_supers)
    subs, scale_supers = _two_level((high - low) / 15)
    scales = _expand(subs, scale_supers)
    safe = torch.where(scales > 0, scales, 1.0).view(w.shape[0], -1, 1)
    x = w.detach().cpu().float().view(w.shape[0], -1, GROUP)
    q = torch.round((x - low.view(w.shape[0], -1, 1)) / safe).clamp(0, 15).to(torch.uint8).view(w.shape)
    return QuantizedWeight.from_groups(q, subs, min_subs, 4, torch.stack([scale_supers, -min_supers], dim=-1))
