"""`pagedserve::rms_norm` and `pagedserve::add_rms_norm`, numerically identical to HF Qwen3RMSNorm."""
from __future__ import annotations

import torch
from torch import Tensor

from ops._registry import NAMESPACE, impl, register, require


def _check(op: str, x: Tensor, weight: Tensor) -> None:
    require(weight.dim() == 1 and x.dim() >= 1 and weight.shape[0] == x.shape[-1], op,
            f"weight must be 1-D with x.shape[-1]={x.shape[-1] if x.dim() else None} entries, "
            f"got weight {tuple(weight.shape)} for x {tuple(x.shape)}")
    require(x.is_floating_point() and weight.is_floating_point(), op,
            f"x and weight must be floating point, got {x.dtype} and {weight.dtype}")


def _normalize(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # Same op order as transformers: fp32 statistics, cast back to x.dtype, THEN scale by the weight,
    # so bf16 outputs round exactly where HF's do.
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def reference_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    rows = x.float().reshape(-1, x.shape[-1])
    out = torch.empty_like(rows)
    for i, row in enumerate(rows):
        rms = torch.sqrt((row * row).sum() / row.numel() + eps)
        out[i] = row / rms
    return weight * out.reshape(x.shape).to(x.dtype)


def reference_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    summed = residual + x
    return reference_rms_norm(summed, weight, eps), summed


@register("rms_norm", "cpu")
def torch_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _normalize(x, weight, eps)


@register("add_rms_norm", "cpu")
def torch_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    summed = residual + x
    return _normalize(summed, weight, eps), summed


@torch.library.custom_op(f"{NAMESPACE}::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    _check("rms_norm", x, weight)
    return impl("rms_norm", x.device)(x, weight, eps)


@rms_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    _check("rms_norm", x, weight)
    return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))


@torch.library.custom_op(f"{NAMESPACE}::add_rms_norm", mutates_args=())
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    _check_add("add_rms_norm", x, residual, weight)
    return impl("add_rms_norm", x.device)(x, residual, weight, eps)


@add_rms_norm.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    _check_add("add_rms_norm", x, residual, weight)
    return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype)), torch.empty_like(x)


def _check_add(op: str, x: Tensor, residual: Tensor, weight: Tensor) -> None:
    _check(op, x, weight)
    require(residual.shape == x.shape and residual.dtype == x.dtype, op,
            f"residual must match x: x {tuple(x.shape)} {x.dtype}, residual {tuple(residual.shape)} {residual.dtype}")
