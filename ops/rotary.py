"""`pagedserve::rotary`: neox-style rotary position embedding on q and k, full or partial (rotary_dim < D)."""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ops._registry import NAMESPACE, impl, register, require


def rope_cos_sin(max_pos: int, rotary_dim: int, theta: float, scaling: Mapping[str, Any] | None = None) -> Tensor:
    """Table [max_pos, rotary_dim] fp32: row p is cat(cos(p * inv_freq), sin(p * inv_freq)) times the
    scaling's attention factor. `scaling`: a Hugging Face rope-parameter dict of rope_type "linear", "yarn"
    or "llama3" (as config.json's `rope_scaling` gives it); None = plain rotary.

    inv_freq and the fp32 products are computed exactly as transformers does, so the table is bit-identical.
    """
    require(rotary_dim > 0 and rotary_dim % 2 == 0, "rope_cos_sin",
            f"rotary_dim must be even and > 0, got {rotary_dim}")
    inv_freq, attention_factor = _inv_freq(rotary_dim, theta, scaling or {})
    freqs = torch.arange(max_pos, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    return table * attention_factor if attention_factor != 1.0 else table


def _inv_freq(dim: int, theta: float, scaling: Mapping[str, Any]) -> tuple[Tensor, float]:
    """The rotary frequencies and the factor cos and sin are scaled by, in transformers' own order of
    operations (modeling_rope_utils), so that both round alike."""
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    require(kind in ("default", "linear", "yarn", "llama3"), "rope_cos_sin",
            f"rope_type must be default, linear, yarn or llama3, got {kind!r}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "default":
        return inv_freq, 1.0
    factor, original = scaling["factor"], scaling.get("original_max_position_embeddings")
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        medium = ~(wavelen < original / high) * ~(wavelen > original / low)
        return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled), 1.0
    # yarn: the low frequencies interpolated (divided by factor), the high ones kept, a linear ramp between
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all
                     else _yarn_mscale(factor))

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    return 0.1 * mscale * math.log(scale) + 1.0 if scale > 1 else 1.0


def _check(q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor, rotary_dim: int) -> None:
    op = "rotary"
    require(q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2], op,
            f"q must be [T, Hq, D] and k [T, Hk, D] with the same T and D, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    require(q.dtype == k.dtype, op, f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    require(positions.dtype == torch.int64 and positions.shape == (q.shape[0],), op,
            f"positions must be int64 [T={q.shape[0]}], got {positions.dtype} {tuple(positions.shape)}")
    require(rotary_dim > 0 and rotary_dim % 2 == 0 and rotary_dim <= q.shape[2], op,
            f"rotary_dim must be even, > 0 and <= head_dim {q.shape[2]}, got {rotary_dim}")
    require(cos_sin.dim() == 2 and cos_sin.shape[1] == rotary_dim and cos_sin.dtype == torch.float32, op,
            f"cos_sin must be fp32 [P, rotary_dim={rotary_dim}] (build it with ops.rotary.rope_cos_sin), "
            f"got {cos_sin.dtype} {tuple(cos_sin.shape)}")


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int) -> Tensor:
    # cos/sin: [T, 1, rotary_dim/2] in x.dtype. Written as HF's x*cos + rotate_half(x)*sin per half, which
    # rounds identically in bf16 (negation is exact).
    half = rotary_dim // 2
    x1, x2 = x[..., :half], x[..., half:rotary_dim]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotary_dim:]), dim=-1)


def reference_rotary(q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor,
                     rotary_dim: int) -> tuple[Tensor, Tensor]:
    half = rotary_dim // 2

    def rotate_one(x: Tensor) -> Tensor:
        out = x.clone()
        for t, pos in enumerate(positions.tolist()):
            cos = cos_sin[pos, :half].to(x.dtype)
            sin = cos_sin[pos, half:].to(x.dtype)
            rot = x[t, :, :rotary_dim]
            rotated_half = torch.cat((-rot[:, half:], rot[:, :half]), dim=-1)
            out[t, :, :rotary_dim] = rot * torch.cat((cos, cos)) + rotated_half * torch.cat((sin, sin))
        return out

    return rotate_one(q), rotate_one(k)


def rotary_mean(x: Tensor, cos_sin: Tensor, rotary_dim: int) -> Tensor:
    """The mean of x [..., D] rotated to every position of the table (rotation is linear: x rotated by the
    table's mean cos and sin), in fp64."""
    half = rotary_dim // 2
    mean = cos_sin.double().mean(0)
    return _rotate(x.double(), mean[:half], mean[half:], rotary_dim)


@register("rotary", "cpu")
def torch_rotary(q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor, rotary_dim: int) -> tuple[Tensor, Tensor]:
    if positions.numel():
        lo, hi = positions.min().item(), positions.max().item()
        require(lo >= 0 and hi < cos_sin.shape[0], "rotary",
                f"positions must lie in [0, {cos_sin.shape[0]}) (the cos_sin table's rows), got [{lo}, {hi}]; "
                "build a longer table with ops.rotary.rope_cos_sin")
    table = cos_sin.index_select(0, positions).to(q.dtype)[:, None, :]
    half = rotary_dim // 2
    cos, sin = table[..., :half], table[..., half:]
    return _rotate(q, cos, sin, rotary_dim), _rotate(k, cos, sin, rotary_dim)


@torch.library.custom_op(f"{NAMESPACE}::rotary", mutates_args=())
def rotary(q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor, rotary_dim: int) -> tuple[Tensor, Tensor]:
    _check(q, k, positions, cos_sin, rotary_dim)
    return impl("rotary", q.device)(q, k, positions, cos_sin, rotary_dim)


@rotary.register_fake
def _(q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor, rotary_dim: int) -> tuple[Tensor, Tensor]:
    _check(q, k, positions, cos_sin, rotary_dim)
    return torch.empty_like(q), torch.empty_like(k)
