"""`pagedserve::quant_linear`: y = x @ W.T with W a `QuantizedWeight` (ops/quant_weight.py: 4-, 6- or
8-bit integers in groups of 32 along K, and their layout).

Numerics (as llama.cpp): x is quantized per (row, 32-value block) to int8, dx = amax|x_block| / 127,
xq = round-half-even(x / dx) (an all-zero block gives dx = 0, xq = 0), and per (row, group)
    sum_k w * x = dx * (scale * sum q * xq + min * sum xq)
(int6: dx * super * sum over the two halves of sub-scale * sum (q - 32) * xq) with exact integer sums. The reference body below does this math in float64; the C++ kernel
(ops/cpu/quant_linear.cpp) does it with AVX2 integer dot products and fp32 accumulation.

Prefill-sized calls on CPUs with AMX-BF16 (bf16 x of `ops.cpu.DENSE_ROWS` rows or more) skip the activation
rounding instead: y = x @ W_bf16.T with W_bf16 = `dequantize(torch.bfloat16)` and fp32 sums, through torch's
GEMM on the AMX tiles (ops/cpu/quant_rows.cpp). Below that many rows a row's result never depends on the rows
beside it, which speculative verify rows rely on.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ops._registry import NAMESPACE, direct, impl, register, require
from ops.quant_weight import (GROUP, GROUP_BYTES, HALF, Q_DTYPE, ROW_TILE, SUPER, QuantError, QuantizedWeight,
                              supers_per_row)


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (xq [M, K] float32 holding integers in -127..127, dx [M, K // 32] float32)."""
    blocks = x.float().view(x.shape[0], x.shape[1] // GROUP, GROUP)
    dx = blocks.abs().amax(-1) / 127
    xq = torch.where(dx[..., None] > 0, torch.round(blocks / dx[..., None]), 0.0)
    return xq.view(x.shape), dx


def check_weight(op: str, qweight: Tensor, scales: Tensor, mins: Tensor | None, supers: Tensor | None, bits: int,
                 out_features: int) -> None:
    """A QuantizedWeight's tensors as an op takes them (quant_linear, quant_rows)."""
    bits = int(bits)    # dynamo may trace a weight's int attributes as SymInts; a dict key must be an int
    require(bits in Q_DTYPE, op, f"bits={bits}: allowed are 4, 6 and 8")
    require(bits != 6 or (supers is not None and mins is None), op,
            "bits=6 needs supers and takes no mins (build it with QuantizedWeight)")
    require(qweight.dim() == 3 and qweight.dtype == Q_DTYPE[bits] and qweight.shape[2] == GROUP_BYTES[bits]
            and qweight.is_contiguous(), op,
            f"qweight must be a contiguous {Q_DTYPE[bits]} [tiles, K/{GROUP}, {GROUP_BYTES[bits]}] tensor for "
            f"bits={bits} (build it with QuantizedWeight), got {qweight.dtype} {tuple(qweight.shape)}")
    tiles, groups = qweight.shape[:2]
    factor_dtype = torch.float32 if supers is None else torch.int8 if bits == 6 else torch.uint8
    factor_shape = (tiles, groups, ROW_TILE) + ((GROUP // HALF,) if bits == 6 else ())
    for name, t in (("scales", scales), ("mins", mins)):
        require(t is None or (t.dtype == factor_dtype and t.shape == factor_shape and t.is_contiguous()), op,
                f"{name} must be contiguous {factor_dtype} {list(factor_shape)} to match qweight"
                f"{' and supers' if supers is not None else ''}, got {None if t is None else (t.dtype, tuple(t.shape))}")
    if supers is not None:
        shape = (tiles, supers_per_row(groups), 1 + (mins is not None), ROW_TILE)
        require(supers.dtype == torch.float32 and supers.shape == shape and supers.is_contiguous()
                and (bits != 6 or groups % SUPER == 0), op,
                f"supers must be contiguous float32 {list(shape)} (one per {GROUP * SUPER} values; int6: K a "
                f"multiple of {GROUP * SUPER}), got {supers.dtype} {tuple(supers.shape)}")
    require((tiles - 1) * ROW_TILE < out_features <= tiles * ROW_TILE, op,
            f"out_features={out_features} does not fit {tiles} tiles of {ROW_TILE} rows")


def _check(x: Tensor, qweight: Tensor, scales: Tensor, mins: Tensor | None, supers: Tensor | None, bits: int,
           out_features: int) -> None:
    op = "quant_linear"
    check_weight(op, qweight, scales, mins, supers, bits, out_features)
    require(x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16), op,
            f"x must be 2-D [M, K] float32 or bfloat16, got {x.dtype} {tuple(x.shape)}")
    groups = qweight.shape[1]
    require(x.shape[1] == groups * GROUP, op,
            f"x has K={x.shape[1]} features, the weight has {groups * GROUP} ({groups} groups of {GROUP})")
    require(x.device == qweight.device, op, f"x is on {x.device}, the weight on {qweight.device}")


@register("quant_linear", "cpu")
@register("quant_linear", "cuda")
def reference_quant_linear(x: Tensor, qweight: Tensor, scales: Tensor, mins: Tensor | None, supers: Tensor | None,
                           bits: int, out_features: int) -> Tensor:
    """The kernel's math in float64: quantized activations times the exactly dequantized weights."""
    xq, dx = quantize_activations(x)
    x_used = (xq.double().view(*dx.shape, GROUP) * dx.double()[..., None]).view(x.shape)
    w = QuantizedWeight(bits, out_features, x.shape[1], qweight, scales, mins, supers).dequantize(torch.float64)
    return (x_used @ w.T).to(x.dtype)


@torch.library.custom_op(f"{NAMESPACE}::quant_linear", mutates_args=())
def quant_linear_op(x: Tensor, qweight: Tensor, scales: Tensor, mins: Tensor | None, supers: Tensor | None,
                    bits: int, out_features: int) -> Tensor:
    _check(x, qweight, scales, mins, supers, bits, out_features)
    return impl("quant_linear", x.device)(x, qweight, scales, mins, supers, bits, out_features)


@quant_linear_op.register_fake
def _(x: Tensor, qweight: Tensor, scales: Tensor, mins: Tensor | None, supers: Tensor | None, bits: int,
      out_features: int) -> Tensor:
    _check(x, qweight, scales, mins, supers, bits, out_features)
    return x.new_empty((x.shape[0], out_features))


def quant_linear(x: Tensor, w: QuantizedWeight, bias: Tensor | None = None) -> Tensor:
    """x [..., K] float32 or bfloat16 -> [..., N] in x.dtype. Calls the op through `ops._registry.direct`:
    in eager mode that skips custom_op's per-call dispatch (~40 us, a real share of a decode step)."""
    if x.shape[-1] != w.in_features:
        raise QuantError(f"x has {x.shape[-1]} features, the quantized weight ({w.describe()}, "
                         f"[{w.out_features}, {w.in_features}]) expects {w.in_features}")
    flat = x if x.dim() == 2 else x.reshape(-1, w.in_features)
    out = direct.quant_linear(flat, w.qweight, w.scales, w.mins, w.supers, w.bits, w.out_features)
    if x.dim() != 2:
        out = out.view(*x.shape[:-1], w.out_features)
    return out if bias is None else out + bias.to(out.dtype)
