"""`pagedserve::dense_linear`: y = x @ W.T for a dense weight [N, K]. On CPUs a C++ kernel serves
decode-sized batches (ops/cpu/dense_linear.cpp: it streams W once for all rows, where MKL's GEMM read
it at a fifth of the memory bandwidth for 8 rows); prefill chunks and other devices use F.linear."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ops._registry import NAMESPACE, impl, register, require

# Up to this many rows the C++ kernel: MKL's sgemm is slow for skinny shapes here (decode steps of a
# 0.6B-shaped fp32 model, same run: 32 rows 846 -> 605 ms, 64 rows 1624 -> 1308 ms). A prefill chunk
# (hundreds of rows) goes to MKL, which reaches the GEMM probe's rate there.
SMALL_ROWS = 64


def _check(x: Tensor, weight: Tensor) -> None:
    require(x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], "dense_linear",
            f"x must be [M, K] and weight [N, K] with the same K, got x {tuple(x.shape)} and weight "
            f"{tuple(weight.shape)}")
    require(x.dtype == weight.dtype and x.is_floating_point(), "dense_linear",
            f"x and weight must share one floating dtype, got {x.dtype} and {weight.dtype}")


@register("dense_linear", "cpu")
@register("dense_linear", "cuda")
def torch_dense_linear(x: Tensor, weight: Tensor) -> Tensor:
    return F.linear(x, weight)


@torch.library.custom_op(f"{NAMESPACE}::dense_linear", mutates_args=())
def dense_linear(x: Tensor, weight: Tensor) -> Tensor:
    _check(x, weight)
    return impl("dense_linear", x.device)(x, weight)


@dense_linear.register_fake
def _(x: Tensor, weight: Tensor) -> Tensor:
    _check(x, weight)
    return x.new_empty((x.shape[0], weight.shape[0]))
