"""pagedserve::quant_linear and QuantizedWeight: the layout round trip, the quantizers' error bounds, the C++
kernel against the float64 reference, the reference against the plain float product, and compile/opcheck."""
from __future__ import annotations

import pytest
import torch

from ops import OpInputError
from ops.quant_linear import (GROUP, QuantError, QuantizedWeight, quant_linear, quantize_int4, quantize_int8,
                              reference_quant_linear)

Ms = (0, 1, 2, 3, 5, 8, 17, 64, 300)      # 300 rows at K=1024 span two of the kernel's x chunks
SHAPES = ((40, 32), (12, 96), (200, 1024))      # (N, K)


pytestmark = pytest.mark.usefixtures("cpp_kernels")


def _random_groups(n: int, k: int, bits: int, with_mins: bool, seed: int = 0):
    """Random (q, scales, mins) over each type's full range, including int8's -128."""
    g = torch.Generator().manual_seed(seed)
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    else:
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // GROUP, generator=g) * 0.02 + 1e-3
    mins = -torch.rand(n, k // GROUP, generator=g) * 0.1 if with_mins else None
    return q, scales, mins


def _formula(q, scales, mins) -> torch.Tensor:
    """w[n, k] = scales[n, k // 32] * q[n, k] + mins[n, k // 32], in float64."""
    w = q.double() * scales.double().repeat_interleave(GROUP, dim=1)
    return w if mins is None else w + mins.double().repeat_interleave(GROUP, dim=1)


def _run_op(x, w: QuantizedWeight):
    return torch.ops.pagedserve.quant_linear(x, w.qweight, w.scales, w.mins, w.bits, w.out_features)


def _run_reference(x, w: QuantizedWeight):
    return reference_quant_linear(x, w.qweight, w.scales, w.mins, w.bits, w.out_features)


@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("with_mins", (True, False))
@pytest.mark.parametrize("n", (1, 8, 13, 200))
def test_from_groups_round_trips_and_dequantizes_to_the_formula(bits, with_mins, n):
    q, scales, mins = _random_groups(n, 96, bits, with_mins)
    w = QuantizedWeight.from_groups(q, scales, mins, bits)
    q2, scales2, mins2 = w.to_groups()
    assert torch.equal(q2, q) and torch.equal(scales2, scales)
    assert (mins2 is None) == (mins is None) and (mins is None or torch.equal(mins2, mins))
    assert (w.out_features, w.in_features, w.bits) == (n, 96, bits)
    assert torch.equal(w.dequantize(torch.float64), _formula(q, scales, mins))
    assert torch.allclose(w.dequantize(), _formula(q, scales, mins).float(), rtol=1e-6, atol=1e-7)
    assert w.describe() == f"int{bits} g32 {'asym' if with_mins else 'sym'}"
    padded = -(-n // 8) * 8
    assert w.nbytes == padded * 96 * bits // 8 + padded * 3 * 4 * (2 if with_mins else 1)


@pytest.mark.parametrize("group_size", (32, 64, 128))
def test_quantizers_keep_each_weight_within_half_a_step(group_size):
    w = torch.randn(24, 256, generator=torch.Generator().manual_seed(1))
    w[3, :group_size] = 0.5                  # a constant group: int4's range is zero, the value exact
    for qw in (quantize_int4(w, group_size), quantize_int8(w, group_size)):
        q, scales, mins = qw.to_groups()
        step = scales.repeat_interleave(GROUP, dim=1)
        err = (qw.dequantize() - w).abs()
        assert bool((err <= step / 2 * (1 + 1e-5) + 1e-6).all()), f"{qw.describe()}: worst {err.max()}"
        shared = scales.view(24, -1, group_size // GROUP)
        assert bool((shared == shared[..., :1]).all()), "a larger group's scale is repeated for each 32"
    assert bool((quantize_int4(w, group_size).dequantize()[3, :group_size] == 0.5).all())
    assert quantize_int8(w).mins is None and quantize_int4(w).mins is not None
    assert int(quantize_int4(w).to_groups()[0].max()) <= 15


def _activations(m: int, k: int, dtype, seed: int) -> torch.Tensor:
    """Gaussian rows with an all-zero block, a single spike and values far from 1 in scale."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 2, max(m, 1))[:m, None]
    if m >= 2:
        x[1, :GROUP] = 0
        x[0, 5] = 300.0
    return x.to(dtype)


@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("with_mins", (True, False))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_kernel_matches_the_reference(bits, with_mins, dtype):
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    for n, k in SHAPES:
        w = QuantizedWeight.from_groups(*_random_groups(n, k, bits, with_mins, seed=n + k), bits)
        for m in Ms:
            x = _activations(m, k, dtype, seed=m)
            out, ref = _run_op(x, w), _run_reference(x, w)
            assert out.shape == (m, n) and out.dtype == dtype
            scale = ref.float().abs().amax(-1, keepdim=True).clamp_min(1e-30)
            torch.testing.assert_close(out.float() / scale, ref.float() / scale, **tol,
                                       msg=lambda s: f"bits={bits} mins={with_mins} M={m} N={n} K={k}: {s}")


def test_reference_is_close_to_the_float_product():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 1024, generator=g)
    for qw in (quantize_int4(torch.randn(96, 1024, generator=g)), quantize_int8(torch.randn(96, 1024, generator=g))):
        exact = x @ qw.dequantize().T
        for out in (_run_reference(x, qw), _run_op(x, qw)):
            rel = float((out - exact).norm() / exact.norm())
            assert rel < 0.02, f"{qw.describe()}: relative error {rel:.4f} of x's int8 quantization"


def test_quant_linear_takes_any_leading_shape_and_a_bias():
    g = torch.Generator().manual_seed(4)
    qw = quantize_int4(torch.randn(20, 64, generator=g))
    x, bias = torch.randn(2, 3, 64, generator=g), torch.randn(20, generator=g)
    out = quant_linear(x, qw, bias)
    assert out.shape == (2, 3, 20)
    torch.testing.assert_close(out, _run_reference(x.view(6, 64), qw).view(2, 3, 20) + bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ns", ((16, 8, 24), (12, 40, 7), (8, 5)))
@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("mins", ("all", "some"))
def test_cat_equals_the_concatenated_weights(ns, bits, mins):
    """Also when only some parts have mins (a Q6_K part requantized to symmetric int8 next to Q4_K ones)."""
    parts = [QuantizedWeight.from_groups(*_random_groups(n, 64, bits, mins == "all" or i % 2 == 0, seed=i), bits)
             for i, n in enumerate(ns)]
    joined = QuantizedWeight.cat(parts)
    assert joined.out_features == sum(ns)
    assert torch.equal(joined.dequantize(), torch.cat([p.dequantize() for p in parts]))
    x = torch.randn(3, 64)
    torch.testing.assert_close(_run_op(x, joined), torch.cat([_run_op(x, p) for p in parts], dim=1),
                               rtol=1e-5, atol=1e-5)


def test_bad_weights_raise_quant_errors_naming_the_value():
    q, scales, mins = _random_groups(8, 64, 4, True)
    cases = [
        (lambda: QuantizedWeight.from_groups(q, scales, mins, 3), "bits=3"),
        (lambda: QuantizedWeight.from_groups(q.to(torch.int8), scales, mins, 4), "torch.uint8"),
        (lambda: QuantizedWeight.from_groups(q[:, :40], scales, mins, 4), "multiple of 32"),
        (lambda: QuantizedWeight.from_groups(q | 16, scales, mins, 4), "0..15"),
        (lambda: QuantizedWeight.from_groups(q, scales[:, :1], mins, 4), "scales must be float32 [8, 2]"),
        (lambda: QuantizedWeight.from_groups(q, scales, mins.double(), 4), "mins must be float32"),
        (lambda: quantize_int4(torch.randn(8, 64), group_size=48), "group_size=48"),
        (lambda: quantize_int8(torch.randn(8, 80)), "K a multiple of group_size=32"),
        (lambda: QuantizedWeight.cat([quantize_int4(torch.randn(8, 64)), quantize_int8(torch.randn(8, 64))]),
         "share bits"),
        (lambda: quant_linear(torch.randn(2, 32), quantize_int8(torch.randn(8, 64))), "expects 64"),
    ]
    for call, words in cases:
        with pytest.raises(QuantError, match=words.replace("[", r"\[").replace(".", r"\.")):
            call()


def test_bad_op_inputs_raise_op_input_errors():
    w = quantize_int4(torch.randn(12, 64))
    op = torch.ops.pagedserve.quant_linear
    cases = [
        (lambda: op(torch.randn(2, 64), w.qweight, w.scales, w.mins, 8, 12), "bits=8"),
        (lambda: op(torch.randn(2, 64).half(), w.qweight, w.scales, w.mins, 4, 12), "float32 or bfloat16"),
        (lambda: op(torch.randn(2, 96), w.qweight, w.scales, w.mins, 4, 12), "K=96"),
        (lambda: op(torch.randn(2, 64), w.qweight, w.scales, w.mins, 4, 17), "out_features=17"),
        (lambda: op(torch.randn(2, 64), w.qweight, w.scales[:, :1], w.mins, 4, 12), "scales must be contiguous"),
    ]
    for call, words in cases:
        with pytest.raises(OpInputError, match=words):
            call()


@pytest.mark.parametrize("bits, with_mins, dtype", [(4, True, torch.float32), (8, False, torch.bfloat16)])
def test_opcheck(bits, with_mins, dtype):
    w = QuantizedWeight.from_groups(*_random_groups(13, 64, bits, with_mins), bits)
    for m in (0, 3):
        torch.library.opcheck(torch.ops.pagedserve.quant_linear.default,
                              (torch.randn(m, 64).to(dtype), w.qweight, w.scales, w.mins, bits, 13))


@pytest.mark.parametrize("dynamic", (False, True))
def test_compiled_equals_eager(tmp_path, monkeypatch, dynamic):
    """dynamic=True is how the engine compiles its step: dynamo then traces the weights' int
    attributes (bits, out_features) as symbolic ints, which the op's checks must accept."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    w4, w8 = quantize_int4(torch.randn(40, 64)), quantize_int8(torch.randn(13, 32))

    def mlp(x):
        return quant_linear(torch.relu(quant_linear(x * 2, w4)[..., :32]), w8) + 1

    compiled = torch.compile(mlp, backend="inductor", dynamic=dynamic, fullgraph=True)
    for rows in (3, 5):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(compiled(x), mlp(x), rtol=1e-5, atol=1e-5)
