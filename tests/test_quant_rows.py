"""pagedserve::quant_rows (an embedding lookup in a table kept quantized): the C++ kernel gives each id's row
of `QuantizedWeight.dequantize(dtype)` bit for bit, in every format, and refuses ids outside the table."""
from __future__ import annotations

import pytest
import torch
from test_quant_linear import FORMATS, _random_groups

import ops.cpu
from ops import OpInputError
from ops.quant_rows import quant_rows, reference_quant_rows
from ops.quant_weight import QuantizedWeight, quantize_int4

pytestmark = pytest.mark.usefixtures("cpp_kernels")


@pytest.mark.parametrize("bits, with_mins, two_level", FORMATS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("k", (256, 896))            # 896: the last super-block has 4 groups
def test_rows_are_the_dequantized_weights_rows(bits, with_mins, two_level, dtype, k):
    if bits == 6 and k % 256:
        return
    n = 61                                            # the last tile has 5 rows
    q, scales, mins, supers = _random_groups(n, k, bits, with_mins, seed=bits + k, two_level=two_level)
    w = QuantizedWeight.from_groups(q, scales, mins, bits, supers)
    ids = torch.tensor([[0, 7, 8, 60], [33, 33, 1, 59]])   # tile edges, the last row, a repeat
    got = quant_rows(w, ids, dtype)
    assert got.shape == (2, 4, k) and got.dtype == dtype
    assert torch.equal(got, w.dequantize(dtype)[ids])
    assert torch.equal(got.view(-1, k), reference_quant_rows(ids.flatten(), w.qweight, w.scales, w.mins, w.supers,
                                                             bits, n, dtype))


def test_the_kernel_serves_the_cpu_lookup_and_refuses_ids_outside_the_table():
    assert ops.cpu.CPP_BODIES["quant_rows"] is ops.cpu.cpp_quant_rows
    w = quantize_int4(torch.randn(20, 64))
    assert quant_rows(w, torch.tensor([], dtype=torch.int64), torch.float32).shape == (0, 64)
    for bad in (20, -1):
        with pytest.raises(OpInputError, match=rf"ids must lie in \[0, 20\) \(the weight's rows\), got {bad}"):
            quant_rows(w, torch.tensor([3, bad]), torch.float32)
    op = torch.ops.pagedserve.quant_rows
    with pytest.raises(OpInputError, match="ids must be int64"):
        op(torch.tensor([3], dtype=torch.int32), w.qweight, w.scales, w.mins, w.supers, 4, 20, torch.float32)
    with pytest.raises(OpInputError, match="allowed are float32 and bfloat16"):
        op(torch.tensor([3]), w.qweight, w.scales, w.mins, w.supers, 4, 20, torch.float16)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_opcheck(dtype):
    w = quantize_int4(torch.randn(13, 256))
    for ids in (torch.tensor([], dtype=torch.int64), torch.tensor([12, 0, 5])):
        torch.library.opcheck(torch.ops.pagedserve.quant_rows.default,
                              (ids, w.qweight, w.scales, w.mins, w.supers, 4, 13, dtype))
