"""`pagedserve::silu_and_mul`: the SwiGLU activation of a fused gate/up projection (gate first, then up)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ops._registry import NAMESPACE, impl, register, require


def _check(x: Tensor) -> None:
    require(x.dim() >= 1 and x.shape[-1] % 2 == 0, "silu_and_mul",
            f"x must end in an even dimension [.., 2*I] (gate then up), got {tuple(x.shape)}")


def reference_silu_and_mul(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    gate, up = x[..., :half].float(), x[..., half:]
    return (gate / (1 + torch.exp(-gate))).to(x.dtype) * up


@register("silu_and_mul", "cpu")
def torch_silu_and_mul(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


@torch.library.custom_op(f"{NAMESPACE}::silu_and_mul", mutates_args=())
def silu_and_mul(x: Tensor) -> Tensor:
    _check(x)
    return impl("silu_and_mul", x.device)(x)


@silu_and_mul.register_fake
def _(x: Tensor) -> Tensor:
    _check(x)
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))
