"""pagedserve::quant_linear and QuantizedWeight: the layout round trip, the quantizers' error bounds, the C++
kernel against the float64 reference, the reference against the plain float product, and compile/opcheck."""
from __future__ import annotations

import re

import pytest
import torch

import ops.cpu
from ops import OpInputError
from ops.quant_linear import quant_linear, reference_quant_linear
from ops.quant_weight import (GROUP, HALF, SUPER, QuantError, QuantizedWeight, quantize_int4, quantize_int8,
                              supers_per_row)

Ms = (0, 1, 2, 3, 5, 8, 17, 64, 300)      # 300 rows at K=1024 span two of the kernel's x chunks
SHAPES = ((40, 32), (12, 96), (13, 512), (200, 1024))      # (N, K)


pytestmark = pytest.mark.usefixtures("cpp_kernels")


def _random_groups(n: int, k: int, bits: int, with_mins: bool, seed: int = 0, two_level: bool = False):
    """Random (q, scales, mins, supers) over each type's full range, including int8's -128. Two-level:
    uint8 sub-values 0..255 under fp16-representable supers (a GGUF K-quant's form). int6 (always
    two-level, no mins): q 0..63 and int8 sub-scales -128..127 per 16 values, as Q6_K stores them."""
    g = torch.Generator().manual_seed(seed)
    if bits == 6:
        assert two_level and not with_mins
        return (torch.randint(0, 64, (n, k), generator=g, dtype=torch.uint8),
                torch.randint(-128, 128, (n, k // HALF), generator=g, dtype=torch.int8), None,
                (torch.rand(n, k // GROUP // SUPER, 1, generator=g) * 1e-4 + 1e-5).half().float())
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    else:
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    if two_level:
        def sub():
            return torch.randint(0, 256, (n, k // GROUP), generator=g, dtype=torch.uint8)
        supers = (torch.rand(n, supers_per_row(k // GROUP), 2 if with_mins else 1, generator=g) * 1e-4
                  + 1e-5).half().float()
        if with_mins:
            supers[..., 1] *= -1
        return q, sub(), sub() if with_mins else None, supers
    scales = torch.rand(n, k // GROUP, generator=g) * 0.02 + 1e-3
    mins = -torch.rand(n, k // GROUP, generator=g) * 0.1 if with_mins else None
    return q, scales, mins, None


def _flat(scales, mins, supers):
    """Two-level factors multiplied out in fp32, as the format defines them."""
    if supers is None:
        return scales, mins
    per_group = supers.repeat_interleave(SUPER, dim=1)[:, :scales.shape[1]]
    return per_group[..., 0] * scales.float(), None if mins is None else per_group[..., 1] * mins.float()


def _formula(q, scales, mins) -> torch.Tensor:
    """w[n, k] = scales[n, k // 32] * q[n, k] + mins[n, k // 32], in float64."""
    w = q.double() * scales.double().repeat_interleave(GROUP, dim=1)
    return w if mins is None else w + mins.double().repeat_interleave(GROUP, dim=1)


def _run_op(x, w: QuantizedWeight):
    return torch.ops.pagedserve.quant_linear(x, w.qweight, w.scales, w.mins, w.supers, w.bits, w.out_features)


def _run_reference(x, w: QuantizedWeight):
    return reference_quant_linear(x, w.qweight, w.scales, w.mins, w.supers, w.bits, w.out_features)


@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("with_mins", (True, False))
@pytest.mark.parametrize("n", (1, 8, 13, 200))
@pytest.mark.parametrize("two_level", (False, True))
@pytest.mark.parametrize("k", (96, 512, 896))       # two-level: 896 ends in a super-block of 4 groups
def test_from_groups_round_trips_and_dequantizes_to_the_formula(bits, with_mins, n, two_level, k):
    groups = _random_groups(n, k, bits, with_mins, two_level=two_level)
    w = QuantizedWeight.from_groups(*groups[:3], bits, groups[3])
    for got, given in zip(w.to_groups(), groups):
        assert (got is None and given is None) or torch.equal(got, given)
    assert (w.out_features, w.in_features, w.bits) == (n, k, bits)
    scales, mins = _flat(*groups[1:])
    assert all(torch.equal(a, b) for a, b in zip(w.flat_groups(), (groups[0], scales, mins)) if b is not None)
    assert torch.equal(w.dequantize(torch.float64), _formula(groups[0], scales, mins))
    assert torch.allclose(w.dequantize(), _formula(groups[0], scales, mins).float(), rtol=1e-6, atol=1e-7)
    assert w.describe() == f"int{bits} {'g32x8' if two_level else 'g32'} {'asym' if with_mins else 'sym'}"
    padded, factors = -(-n // 8) * 8, 2 if with_mins else 1
    per_row = (k // GROUP + 4 * supers_per_row(k // GROUP)) if two_level else 4 * (k // GROUP)   # factor bytes
    assert w.nbytes == padded * k * bits // 8 + padded * per_row * factors
    assert torch.equal(w.flattened().dequantize(torch.float64), w.dequantize(torch.float64))


@pytest.mark.parametrize("n", (1, 8, 13, 200))
def test_int6_round_trips_and_dequantizes_to_q6_k_formula(n):
    """w = super * sub-scale(16 values) * (q - 32), exact in float32 too; the top two bits of a value sit
    where the layout says (checked through a single set value)."""
    k = 512
    q, scales, mins, supers = _random_groups(n, k, 6, False, seed=n, two_level=True)
    w = QuantizedWeight.from_groups(q, scales, None, 6, supers)
    back = w.to_groups()
    assert torch.equal(back[0], q) and torch.equal(back[1], scales) and back[2] is None and torch.equal(back[3], supers)
    expected = ((q.double() - 32) * scales.double().repeat_interleave(HALF, dim=1)
                * supers[..., 0].double().repeat_interleave(GROUP * SUPER, dim=1))
    assert torch.equal(w.dequantize(torch.float64), expected)
    assert torch.equal(w.dequantize(), expected.float())
    assert w.describe() == "int6 g16x16 sym"
    padded = -(-n // 8) * 8
    assert w.nbytes == padded * k * 6 // 8 + padded * (k // HALF) + padded * (k // 256) * 4
    one = torch.zeros(8, 256, dtype=torch.uint8)
    one[1, 19] = 0b110000   # row 1, value 19: vector 2 (H1's first), low nibble of byte 4 * 1 + 3
    one[4, 13] = 0b100000   # row 4, value 13: vector 1 (H0's second), high nibble of byte 4 * 4 + 1
    top = QuantizedWeight.from_groups(one, scales[:1].repeat(8, 1)[:, :16], None, 6, supers[:1, :1].repeat(8, 1, 1))
    high = top.qweight[0, 0, 128:]
    assert high.nonzero().flatten().tolist() == [17, 32 + 7]
    assert int(high[17]) == 0b10 << 6 and int(high[39]) == 0b11
    assert not top.qweight[0, 0, :128].any()


def test_int4_layout_interleaves_each_rows_values_by_four():
    """Vector p, byte 4i + j: row i's value 8p + j in the low nibble, 8p + 4 + j in the high one."""
    q = torch.zeros(8, 32, dtype=torch.uint8)
    q[5, 14] = 9            # p = 1, high nibble, j = 2: byte 32 + 4 * 5 + 2
    q[2, 25] = 7            # p = 3, low nibble, j = 1: byte 96 + 4 * 2 + 1
    w = QuantizedWeight.from_groups(q, torch.ones(8, 1), None, 4)
    packed = w.qweight[0, 0]
    assert packed.nonzero().flatten().tolist() == [54, 105]
    assert int(packed[54]) == 9 << 4 and int(packed[105]) == 7


@pytest.mark.parametrize("bits,two_level", ((4, False), (4, True), (8, True), (6, True)))
def test_rows_are_the_dequantized_weights_rows(bits, two_level):
    """An embedding lookup in a quantized table: rows across tiles, repeated, and in the padded last tile."""
    n, k = 21, 512
    q, scales, mins, supers = _random_groups(n, k, bits, bits == 4, seed=3, two_level=two_level)
    w = QuantizedWeight.from_groups(q, scales, mins, bits, supers)
    ids = torch.tensor([20, 0, 7, 8, 8, 15, 16])
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(w.rows(ids, dtype), w.dequantize(dtype)[ids])


@pytest.mark.parametrize("group_size", (32, 64, 128))
@pytest.mark.parametrize("k", (384, 512))       # 384: the last super-block has 4 groups
def test_quantizers_keep_each_weight_within_half_a_step(group_size, k):
    w = torch.randn(24, k, generator=torch.Generator().manual_seed(1))
    w[3, :group_size] = 0.5                  # a constant group (above zero: its two-level min is 0)
    w[5, :256] = torch.rand(256) + 2         # a super-block above zero: two-level mins are 0 there
    for qw in (quantize_int4(w, group_size), quantize_int8(w, group_size)):
        assert qw.supers is not None
        q, scales, mins = qw.flat_groups()
        step = scales.repeat_interleave(GROUP, dim=1)
        err = (qw.dequantize() - w).abs()
        assert bool((err <= step / 2 * (1 + 1e-5) + 1e-6).all()), f"{qw.describe()}: worst {err.max()}"
        shared = scales.view(24, -1, group_size // GROUP)
        assert bool((shared == shared[..., :1]).all()), "a larger group's scale is repeated for each 32"
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


FORMATS = [(bits, with_mins, two_level) for bits in (4, 8) for with_mins in (True, False)
           for two_level in (False, True)] + [(6, False, True)]


@pytest.mark.parametrize("bits, with_mins, two_level", FORMATS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_kernel_matches_the_reference(bits, with_mins, dtype, two_level, monkeypatch):
    monkeypatch.setattr(ops.cpu, "DENSE_ROWS", 2**31 - 1)   # the integer kernels (the dense path: test_quant_dense)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    for n, k in SHAPES:
        if bits == 6 and k % (GROUP * SUPER):
            continue
        groups = _random_groups(n, k, bits, with_mins, seed=n + k, two_level=two_level)
        w = QuantizedWeight.from_groups(*groups[:3], bits, groups[3])
        for m in Ms:
            x = _activations(m, k, dtype, seed=m)
            out, ref = _run_op(x, w), _run_reference(x, w)
            assert out.shape == (m, n) and out.dtype == dtype
            scale = ref.float().abs().amax(-1, keepdim=True).clamp_min(1e-30)
            torch.testing.assert_close(out.float() / scale, ref.float() / scale, **tol,
                                       msg=lambda s: f"bits={bits} mins={with_mins} M={m} N={n} K={k}: {s}")
            if two_level and bits != 6:   # the same fp32 factors as the flat form: the same sums, bit for bit
                assert torch.equal(out, _run_op(x, w.flattened()))


@pytest.mark.parametrize("bits, with_mins, two_level", FORMATS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_a_row_comes_out_the_same_bit_for_bit_whatever_the_rows_beside_it(bits, with_mins, two_level, dtype):
    """A speculative verify row's tokens must get exactly what decode steps compute for them (greedy output
    then cannot change): each of 9 rows (row blocks of 4 and 8, the matrix-tile path from 6 rows) equals the
    same row alone."""
    groups = _random_groups(200, 1024, bits, with_mins, seed=bits, two_level=two_level)
    w = QuantizedWeight.from_groups(*groups[:3], bits, groups[3])
    x = _activations(9, 1024, dtype, seed=bits + 1)
    together = _run_op(x, w)
    for i in range(9):
        assert torch.equal(_run_op(x[i:i + 1].contiguous(), w)[0], together[i])


@pytest.mark.parametrize("bits, with_mins, two_level", [f for f in FORMATS if f[0] != 8])
def test_vnni_and_maddubs_tiles_give_the_same_bits(bits, with_mins, two_level):
    """The int4 / int6 tiles' two forms of the integer sums (dpbusd where the CPU has AVX-512 VNNI, an exact
    emulation of it elsewhere; maddubs pair sums) agree bit for bit, at every row-block size (int4 blocks of up
    to 8 rows where AVX-512 gives 32 vector registers, else 4)."""
    for n, k in SHAPES:
        if bits == 6 and k % (GROUP * SUPER):
            continue
        groups = _random_groups(n, k, bits, with_mins, seed=n * k, two_level=two_level)
        w = QuantizedWeight.from_groups(*groups[:3], bits, groups[3])
        for m in (1, 2, 3, 4, 6, 7, 9):
            x = _activations(m, k, torch.float32, seed=m)
            outs = [torch.ops.pagedserve_cpu.quant_linear(x, w.qweight, w.scales, w.mins, w.supers, w.bits,
                                                          w.out_features, vnni) for vnni in (True, False)]
            assert torch.equal(*outs), f"bits={bits} M={m} N={n} K={k}"


@pytest.mark.parametrize("bits, with_mins, two_level", [f for f in FORMATS if f[0] != 8])
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_matrix_and_vector_tiles_give_the_same_bits(bits, with_mins, two_level, dtype):
    """The matrix-tile path (AMX where the CPU grants it, the same integer sums in scalar code elsewhere) and
    the vector tiles agree bit for bit: row counts below, at and past one 16-row tile, an odd tile count (its
    last tile takes the vector kernels) and an odd group count."""
    shapes = [(24, 256), (40, 512), (16, 1536)] + ([] if bits == 6 else [(16, 96), (24, 896)])
    for n, k in shapes:
        groups = _random_groups(n, k, bits, with_mins, seed=n + 7 * k, two_level=two_level)
        w = QuantizedWeight.from_groups(*groups[:3], bits, groups[3])
        for m in (1, 6, 9, 13, 16, 17, 40):
            x = _activations(m, k, dtype, seed=m + k)
            outs = [torch.ops.pagedserve_cpu.quant_linear(x, w.qweight, w.scales, w.mins, w.supers, w.bits,
                                                          w.out_features, None, matrix) for matrix in (True, False)]
            assert torch.equal(*outs), f"bits={bits} M={m} N={n} K={k} {dtype}"


def test_matrix_rows_say_when_the_default_takes_the_matrix_tiles():
    rows = torch.ops.pagedserve_cpu.quant_linear_matrix_rows()
    amx = "amx_int8" in ops.cpu.INSTRUCTION_SETS
    assert (rows > 1) == amx, f"matrix rows {rows} from kernels built {'with' if amx else 'without'} AMX-INT8"


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
@pytest.mark.parametrize("two_level", ("all", "some", "none"))
def test_cat_equals_the_concatenated_weights(ns, bits, mins, two_level):
    """Also when only some parts have mins (a Q6_K part requantized to symmetric int8 next to Q4_K ones)
    or two-level scales (Q4_K next to Q4_0)."""
    parts = []
    for i, n in enumerate(ns):
        groups = _random_groups(n, 256, bits, mins == "all" or i % 2 == 0, seed=i,
                                two_level=two_level == "all" or (two_level == "some" and i % 2 == 1))
        parts.append(QuantizedWeight.from_groups(*groups[:3], bits, groups[3]))
    joined = QuantizedWeight.cat(parts)
    assert joined.out_features == sum(ns)
    assert (joined.supers is not None) == (two_level == "all")
    assert torch.equal(joined.dequantize(), torch.cat([p.dequantize() for p in parts]))
    x = torch.randn(3, 256)
    torch.testing.assert_close(_run_op(x, joined), torch.cat([_run_op(x, p) for p in parts], dim=1),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ns", ((16, 8, 24), (12, 40, 7)))
def test_int6_parts_cat(ns):
    groups = [_random_groups(n, 256, 6, False, seed=i, two_level=True) for i, n in enumerate(ns)]
    parts = [QuantizedWeight.from_groups(q, scales, None, 6, supers) for q, scales, _, supers in groups]
    joined = QuantizedWeight.cat(parts)
    assert joined.bits == 6 and joined.out_features == sum(ns)
    assert torch.equal(joined.dequantize(), torch.cat([p.dequantize() for p in parts]))
    x = torch.randn(3, 256)
    torch.testing.assert_close(_run_op(x, joined), torch.cat([_run_op(x, p) for p in parts], dim=1),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("two_level", (False, True))
def test_int4_widens_to_int8_without_loss(two_level):
    groups = _random_groups(12, 256, 4, True, two_level=two_level)
    w4 = QuantizedWeight.from_groups(*groups[:3], 4, groups[3])
    w8 = w4.with_bits(8)
    assert w8.bits == 8 and (w8.supers is not None) == two_level
    assert torch.equal(w8.dequantize(torch.float64), w4.dequantize(torch.float64))
    with pytest.raises(QuantError, match="only int4 -> int8"):
        w8.with_bits(4)


def test_bad_weights_raise_quant_errors_naming_the_value():
    q, scales, mins, _ = _random_groups(8, 64, 4, True)
    q2, subs, sub_mins, supers = _random_groups(8, 256, 4, True, two_level=True)
    q6, scales6, _, supers6 = _random_groups(8, 256, 6, False, two_level=True)
    w6 = QuantizedWeight.from_groups(q6, scales6, None, 6, supers6)
    cases = [
        (lambda: QuantizedWeight.from_groups(q6, scales6, None, 6), "bits=6 (Q6_K's form) takes int8 sub-scales"),
        (lambda: QuantizedWeight.from_groups(q6, scales6, scales6, 6, supers6), "got mins"),
        (lambda: QuantizedWeight.from_groups(q6, scales6.to(torch.uint8), None, 6, supers6),
         "scales must be torch.int8 [8, 16] (one per row and 16 values"),
        (lambda: QuantizedWeight.from_groups(q6 | 64, scales6, None, 6, supers6), "0..63"),
        (lambda: w6.flattened(), "int6 has a scale per 16 values"),
        (lambda: w6.with_bits(8), "only int4 -> int8"),
        (lambda: QuantizedWeight.from_groups(q6[:, :64], scales6[:, :4], None, 6, supers6),
         "bits=6 (Q6_K's form) needs in_features a multiple of 256, got 64"),
        (lambda: QuantizedWeight.from_groups(q2, subs, sub_mins, 4, supers[..., :1]), "supers must be float32 [8, 1, 2]"),
        (lambda: QuantizedWeight.from_groups(q2, subs.float(), sub_mins, 4, supers), "scales must be torch.uint8"),
        (lambda: QuantizedWeight.from_groups(q, scales, mins, 3), "bits=3"),
        (lambda: QuantizedWeight.from_groups(q.to(torch.int8), scales, mins, 4), "torch.uint8"),
        (lambda: QuantizedWeight.from_groups(q[:, :40], scales, mins, 4), "multiple of 32"),
        (lambda: QuantizedWeight.from_groups(q | 16, scales, mins, 4), "0..15"),
        (lambda: QuantizedWeight.from_groups(q, scales[:, :1], mins, 4), "scales must be torch.float32 [8, 2]"),
        (lambda: QuantizedWeight.from_groups(q, scales, mins.double(), 4), "mins must be torch.float32"),
        (lambda: quantize_int4(torch.randn(8, 64), group_size=48), "group_size=48"),
        (lambda: quantize_int8(torch.randn(8, 80)), "K a multiple of group_size=32"),
        (lambda: QuantizedWeight.cat([quantize_int4(torch.randn(8, 64)), quantize_int8(torch.randn(8, 64))]),
         "share bits"),
        (lambda: quant_linear(torch.randn(2, 32), quantize_int8(torch.randn(8, 64))), "expects 64"),
    ]
    for call, words in cases:
        with pytest.raises(QuantError, match=re.escape(words)):
            call()


def test_bad_op_inputs_raise_op_input_errors():
    w = quantize_int4(torch.randn(12, 64)).flattened()
    groups = _random_groups(12, 256, 4, True, two_level=True)
    w2 = QuantizedWeight.from_groups(*groups[:3], 4, groups[3])
    groups6 = _random_groups(12, 256, 6, False, two_level=True)
    w6 = QuantizedWeight.from_groups(*groups6[:3], 6, groups6[3])
    op = torch.ops.pagedserve.quant_linear
    cases = [
        (lambda: op(torch.randn(2, 64), w.qweight, w.scales, w.mins, None, 8, 12), "bits=8"),
        (lambda: op(torch.randn(2, 64).half(), w.qweight, w.scales, w.mins, None, 4, 12), "float32 or bfloat16"),
        (lambda: op(torch.randn(2, 96), w.qweight, w.scales, w.mins, None, 4, 12), "K=96"),
        (lambda: op(torch.randn(2, 64), w.qweight, w.scales, w.mins, None, 4, 17), "out_features=17"),
        (lambda: op(torch.randn(2, 64), w.qweight, w.scales[:, :1], w.mins, None, 4, 12), "scales must be contiguous"),
        (lambda: op(torch.randn(2, 256), w2.qweight, w2.scales, w2.mins, None, 4, 12), "scales must be contiguous torch.float32"),
        (lambda: op(torch.randn(2, 256), w2.qweight, w2.scales, w2.mins, w2.supers[:, :, :1].contiguous(), 4, 12),
         "supers must be contiguous float32"),
        (lambda: op(torch.randn(2, 256), w6.qweight, w6.scales, None, None, 6, 12), "bits=6 needs supers"),
        (lambda: op(torch.randn(2, 256), w6.qweight, w6.scales.view(torch.uint8), None, w6.supers, 6, 12),
         r"scales must be contiguous torch.int8 \[2, 8, 8, 2\]"),
        (lambda: op(torch.randn(2, 256), w2.qweight, w2.scales, None, w2.supers[:, :, :1].contiguous(), 6, 12),
         "qweight must be a contiguous torch.uint8"),
    ]
    for call, words in cases:
        with pytest.raises(OpInputError, match=words):
            call()


@pytest.mark.parametrize("bits, with_mins, dtype, two_level",
                         [(4, True, torch.float32, False), (8, False, torch.bfloat16, False), (4, True, torch.float32, True),
                          (6, False, torch.bfloat16, True)])
def test_opcheck(bits, with_mins, dtype, two_level):
    k = 256 if two_level else 64
    groups = _random_groups(13, k, bits, with_mins, two_level=two_level)
    w = QuantizedWeight.from_groups(*groups[:3], bits, groups[3])
    for m in (0, 3):
        torch.library.opcheck(torch.ops.pagedserve.quant_linear.default,
                              (torch.randn(m, k).to(dtype), w.qweight, w.scales, w.mins, w.supers, bits, 13))


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
