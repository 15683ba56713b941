"""`pagedserve::rotary`: neox-style rotary position embedding on q and k, full or partial (rotary_dim < D)."""
from __future__ import annotations

import torch
from torch import Tensor

from ops._registry import NAMESPACE, impl, register, require


def rope_cos_sin(max_pos: int, rotary_dim: int, theta: float) -> Tensor:
    """Table [max_pos, rotary_dim] fp32: row p is cat(cos(p * inv_freq), sin(p * inv_freq)).

    inv_freq and the fp32 products are computed exactly as transformers does, so the table is bit-identical.
    """
    require(rotary_dim > 0 and rotary_dim % 2 == 0, "rope_cos_sin",
            f"rotary_dim must be even and > 0, got {rotary_dim}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    freqs = torch.arange(max_pos, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


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
