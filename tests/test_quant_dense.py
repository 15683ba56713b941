"""quant_linear's dense path for prefill-sized bf16 calls on CPUs with AMX-BF16: the weights dequantized to
bf16 as QuantizedWeight.dequantize gives them, a block of output rows at a time, times x with fp32 sums
(torch's GEMM). The kernel runs on every machine; the op routes calls to it from ops.cpu.DENSE_ROWS rows."""
from __future__ import annotations

import pytest
import torch
from test_quant_linear import FORMATS, _activations, _random_groups

import ops.cpu
from ops.quant_linear import quant_linear
from ops.quant_weight import QuantizedWeight

pytestmark = pytest.mark.usefixtures("cpp_kernels")


def _weight(n: int, k: int, bits: int, with_mins: bool, two_level: bool) -> QuantizedWeight:
    q, scales, mins, supers = _random_groups(n, k, bits, with_mins, seed=n + k + bits, two_level=two_level)
    return QuantizedWeight.from_groups(q, scales, mins, bits, supers)


def _dense(x: torch.Tensor, w: QuantizedWeight, block: int | None = None) -> torch.Tensor:
    return torch.ops.pagedserve_cpu.quant_dense_linear(x, w.qweight, w.scales, w.mins, w.supers, w.bits,
                                                       w.out_features, block)


def _integer(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    return torch.ops.pagedserve_cpu.quant_linear(x, w.qweight, w.scales, w.mins, w.supers, w.bits, w.out_features)


@pytest.mark.parametrize("bits, with_mins, two_level", FORMATS)
@pytest.mark.parametrize("n, k, block", ((61, 256, None), (1030, 512, 512), (45, 256, 20)))
def test_dense_path_is_x_times_the_bf16_weights(bits, with_mins, two_level, n, k, block):
    """One block with a last tile of 5 rows; blocks of 512 rows and 6 more; blocks of 16 (20 rounded down to
    whole tiles) and 13 more."""
    w = _weight(n, k, bits, with_mins, two_level)
    x = _activations(37, k, torch.bfloat16, seed=k)
    out = _dense(x, w, block)
    assert out.shape == (37, n) and out.dtype == torch.bfloat16
    exact = x.double() @ w.dequantize(torch.bfloat16).double().T
    # fp32 sums of exact bf16 products rounded to bf16 once: half a bf16 step of each value, plus the
    # sums' own rounding, small against the row's largest value
    row = exact.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    torch.testing.assert_close(out.double() / row, exact / row, rtol=2**-8, atol=1e-6)


def test_bf16_calls_of_dense_rows_or_more_take_the_dense_path(monkeypatch):
    w = _weight(40, 256, 4, True, True)
    x = _activations(5, 256, torch.bfloat16, seed=1)
    assert not torch.equal(_dense(x, w), _integer(x, w))     # the paths round differently: routing shows
    monkeypatch.setattr(ops.cpu, "DENSE_ROWS", 5)
    assert torch.equal(quant_linear(x, w), _dense(x, w))
    assert torch.equal(quant_linear(x[:4], w), _integer(x[:4], w))
    assert torch.equal(quant_linear(x.float(), w), _integer(x.float(), w))     # fp32 x never


def test_dense_rows_follow_the_build():
    """Where the kernels were built with AMX-BF16 (torch's bf16 GEMM runs on those tiles), prefill chunks
    take the dense path; elsewhere no call does."""
    assert (ops.cpu.DENSE_ROWS < 2**31 - 1) == ("amx_bf16" in ops.cpu.INSTRUCTION_SETS)
