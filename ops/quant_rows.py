"""`pagedserve::quant_rows`: rows `ids` of a QuantizedWeight, dequantized to `dtype`: an embedding lookup in a
table kept quantized. The values are `QuantizedWeight.dequantize(dtype)`'s bit for bit: the formula in fp32,
one rounding per product and per added min, then cast."""
from __future__ import annotations

import torch
from torch import Tensor

from ops._registry import NAMESPACE, direct, impl, register, require
from ops.quant_linear import check_weight
from ops.quant_weight import GROUP, QuantizedWeight

DTYPES = (torch.float32, torch.bfloat16)


def _check(ids: Tensor, qweight: Tensor, scales: Tensor, mins: Tensor | None, supers: Tensor | None, bits: int,
           out_features: int, dtype: torch.dtype) -> None:
    op = "quant_rows"
    check_weight(op, qweight, scales, mins, supers, bits, out_features)
    require(ids.dim() == 1 and ids.dtype == torch.int64, op,
            f"ids must be int64 [N], got {ids.dtype} {tuple(ids.shape)}")
    require(dtype in DTYPES, op, f"dtype {dtype}: allowed are float32 and bfloat16")


@register("quant_rows", "cpu")
@register("quant_rows", "cuda")
def reference_quant_rows(ids: Tensor, qweight: Tensor, scales: Tensor, mins: Tensor | None, supers: Tensor | None,
                         bits: int, out_features: int, dtype: torch.dtype) -> Tensor:
    w = QuantizedWeight(bits, out_features, qweight.shape[1] * GROUP, qweight, scales, mins, supers)
    return w.rows(ids, dtype)


@torch.library.custom_op(f"{NAMESPACE}::quant_rows", mutates_args=())
def quant_rows_op(ids: Tensor, qweight: Tensor, scales: Tensor, mins: Tensor | None, supers: Tensor | None,
                  bits: int, out_features: int, dtype: torch.dtype) -> Tensor:
    _check(ids, qweight, scales, mins, supers, bits, out_features, dtype)
    return impl("quant_rows", ids.device)(ids, qweight, scales, mins, supers, bits, out_features, dtype)


@quant_rows_op.register_fake
def _(ids: Tensor, qweight: Tensor, scales: Tensor, mins: Tensor | None, supers: Tensor | None, bits: int,
      out_features: int, dtype: torch.dtype) -> Tensor:
    _check(ids, qweight, scales, mins, supers, bits, out_features, dtype)
    return qweight.new_empty((ids.shape[0], qweight.shape[1] * GROUP), dtype=dtype)


def quant_rows(w: QuantizedWeight, ids: Tensor, dtype: torch.dtype) -> Tensor:
    """Rows `ids` (int64, any shape) of `w`, [*ids.shape, K] in `dtype`."""
    flat = ids.reshape(-1)
    out = direct.quant_rows(flat, w.qweight, w.scales, w.mins, w.supers, w.bits, w.out_features, dtype)
    return out.view(*ids.shape, w.in_features)
