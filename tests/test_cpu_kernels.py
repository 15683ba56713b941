"""The C++ CPU kernels (ops/cpu) against the pure-torch references, and the fallback when they cannot build."""
from __future__ import annotations

import logging

import pytest
import torch

import ops
import ops.cpu
from ops import _registry
from ops.dense_linear import SMALL_ROWS
from ops.paged_attention import reference_paged_attention
from ops.rms_norm import reference_add_rms_norm, reference_rms_norm
from ops.rotary import reference_rotary, rope_cos_sin, torch_rotary
from ops.silu_and_mul import torch_silu_and_mul
from ops.write_kv import reference_write_kv

pagedserve = torch.ops.pagedserve
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("cpp_kernels")


def _paged(rows, q_heads, kv_heads, head_dim, dtype, *, block=16, pad_tokens=0, head_slice=False, seed=0):
    """rows = [(context_len, new_tokens)] -> q, k_cache, v_cache, qsl, context_lens, block_tables.
    Blocks are shuffled, table entries past a row's context are junk, and with head_slice the caches are
    views that skip every other kv head (non-default strides)."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-ctx // block) for ctx, _ in rows) + 1
    num_blocks = len(rows) * width + 2
    tables = torch.randperm(num_blocks, generator=g)[: len(rows) * width].view(len(rows), width).int()
    for i, (ctx, _) in enumerate(rows):
        tables[i, -(-ctx // block):] = -5 if i % 2 else num_blocks + 9
    stored_heads = 2 * kv_heads if head_slice else kv_heads
    k_cache = torch.zeros(num_blocks, block, stored_heads, head_dim, dtype=dtype)[:, :, ::2 if head_slice else 1]
    v_cache = torch.zeros(num_blocks, block, stored_heads, head_dim, dtype=dtype)[:, :, ::2 if head_slice else 1]
    slots = torch.tensor([int(tables[i, p // block]) * block + p % block
                          for i, (ctx, _) in enumerate(rows) for p in range(ctx)])
    reference_write_kv(k_cache, v_cache, torch.randn(len(slots), kv_heads, head_dim, generator=g).to(dtype),
                       torch.randn(len(slots), kv_heads, head_dim, generator=g).to(dtype), slots)
    q = torch.randn(sum(n for _, n in rows) + pad_tokens, q_heads, head_dim, generator=g).to(dtype)
    qsl = torch.tensor([0] + [sum(n for _, n in rows[: i + 1]) for i in range(len(rows))], dtype=torch.int32)
    return q, k_cache, v_cache, qsl, torch.tensor([c for c, _ in rows], dtype=torch.int32), tables


# decode rows on both sides of block boundaries, a 1-token context, a fresh prefill, a chunk after a prefix
RAGGED = [(15, 1), (16, 1), (17, 1), (1, 1), (33, 1), (20, 20), (40, 7), (64, 1)]


def test_the_kernels_are_what_the_cpu_dispatch_runs():
    for op, body in ops.cpu.CPP_BODIES.items():
        assert _registry.impl(op, CPU) is body


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [40, 64, 128])     # 40: past the last 32-wide step of the value sums
# the kernel takes the one-token rows; also the 7-token row; also the 20-token fresh prompt (else SDPA does)
@pytest.mark.parametrize("kernel_row_tokens", [1, 7, 20])
def test_paged_attention_matches_reference_on_ragged_batch(dtype, group, head_dim, kernel_row_tokens, monkeypatch):
    monkeypatch.setattr(ops.cpu, "KERNEL_ROW_TOKENS", kernel_row_tokens)
    kv_heads = 2
    q, kc, vc, qsl, ctx, tables = _paged(RAGGED, kv_heads * group, kv_heads, head_dim, dtype, pad_tokens=3,
                                         seed=group + head_dim)
    scale = head_dim ** -0.5
    got = pagedserve.paged_attention(q, kc, vc, qsl, ctx, tables, scale)
    want = reference_paged_attention(q, kc, vc, qsl, ctx, tables, scale)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert not got[int(qsl[-1]):].any()                  # padding tokens stay zero


@pytest.mark.parametrize("block", [1, 8, 16, 32])
def test_paged_attention_decode_with_strided_caches_and_any_block_size(block):
    rows = [(block, 1), (block + 1, 1), (3 * block - 1, 1), (2, 1)]
    q, kc, vc, qsl, ctx, tables = _paged(rows, 8, 2, 64, torch.float32, block=block, head_slice=True, seed=block)
    assert not kc.is_contiguous()
    got = pagedserve.paged_attention(q, kc, vc, qsl, ctx, tables, 0.125)
    torch.testing.assert_close(got, reference_paged_attention(q, kc, vc, qsl, ctx, tables, 0.125),
                               **TOL[torch.float32])


AMX_BF16 = "amx_bf16" in ops.cpu.INSTRUCTION_SETS
# bf16 rows: a long one (chunks of 128 positions and a partial one, cut into pieces), and rows ending inside
# a tile, on a tile's edge, after one position; a verify row of 5 tokens
BF16_ROWS = [(300, 1), (15, 1), (32, 1), (1, 1), (129, 1), (40, 5)]


def _decode_bf16(group, head_dim, lanes, *, block=16, head_slice=False, pieces=0, seed=0):
    q, kc, vc, qsl, ctx, tables = _paged(BF16_ROWS, 2 * group, 2, head_dim, torch.bfloat16, block=block,
                                         head_slice=head_slice, seed=seed)
    got, prefill = ops.cpu._lib.paged_attention_decode(q, kc, vc, qsl, ctx, tables, head_dim ** -0.5, pieces,
                                                       lanes, 5)
    assert prefill == 0
    want = reference_paged_attention(q.double(), kc.double(), vc.double(), qsl, ctx, tables, head_dim ** -0.5)
    return got, want


@pytest.mark.parametrize("lanes", [0, 16, 8, 1])     # 0: AMX tiles where the CPU has them; 16: VDPBF16PS
@pytest.mark.parametrize("group", [1, 6, 7, 16])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_bf16_decode_on_every_instruction_set(lanes, group, head_dim):
    got, want = _decode_bf16(group, head_dim, lanes, pieces=3 if group == 6 else 0, seed=group + head_dim)
    torch.testing.assert_close(got.double(), want, **TOL[torch.bfloat16])


@pytest.mark.parametrize("block, head_slice", [(32, False), (16, True), (8, False)])
def test_bf16_decode_with_other_blocks_and_strided_caches(block, head_slice):
    """Blocks of 32 slots and caches that skip every other kv head (the AMX kernel reads both); blocks of 8
    slots (it leaves those to the vector kernels)."""
    got, want = _decode_bf16(6, 128, 0, block=block, head_slice=head_slice, seed=block)
    torch.testing.assert_close(got.double(), want, **TOL[torch.bfloat16])


@pytest.mark.skipif(not AMX_BF16, reason="the kernels have no AMX: the CPU lacks it (or PAGEDSERVE_CPU_MARCH "
                                         "left it out)")
def test_amx_serves_bf16_decode_where_the_cpu_has_it():
    """lanes 0 runs the AMX kernel and lanes 16 the VDPBF16PS one: both right, summed in other orders."""
    amx, want = _decode_bf16(6, 128, 0)
    dot, _ = _decode_bf16(6, 128, 16)
    torch.testing.assert_close(amx.double(), want, **TOL[torch.bfloat16])
    assert not torch.equal(amx, dot)


@pytest.mark.parametrize("lanes", [0, 16, 8, 1])
def test_bf16_slots_past_a_rows_end_may_hold_anything(lanes):
    """A reused block keeps NaN and infinities in the slots past every row's end; the kernels read them with
    the tiles (scores and values) but must give them no weight."""
    q, kc, vc, qsl, ctx, tables = _paged(BF16_ROWS, 12, 2, 128, torch.bfloat16, seed=3)
    written = torch.zeros(kc.shape[:2], dtype=torch.bool)
    for i, (n_ctx, _) in enumerate(BF16_ROWS):
        for p in range(n_ctx):
            written[int(tables[i, p // 16]), p % 16] = True
    want = reference_paged_attention(q.double(), kc.double(), vc.double(), qsl, ctx, tables, 128 ** -0.5)
    for cache, junk in ((kc, float("nan")), (vc, float("inf"))):
        cache[~written] = junk
        cache[~written, :, ::3] = -junk
    got, _ = ops.cpu._lib.paged_attention_decode(q, kc, vc, qsl, ctx, tables, 128 ** -0.5, 0, lanes, 5)
    assert got.isfinite().all()
    torch.testing.assert_close(got.double(), want, **TOL[torch.bfloat16])


@pytest.mark.parametrize("rows", [1, 3, 5, 9])
def test_paged_attention_decode_few_rows_of_many_kv_heads(rows):
    """Few short rows of 8 kv heads (too little work to cut between threads; tests/test_kv_cache_dtype.py
    cuts long rows): every head of every row must come out once."""
    q, kc, vc, qsl, ctx, tables = _paged([(5 + 7 * i, 1) for i in range(rows)], 16, 8, 64, torch.float32,
                                         seed=rows)
    got = pagedserve.paged_attention(q, kc, vc, qsl, ctx, tables, 0.125)
    torch.testing.assert_close(got, reference_paged_attention(q, kc, vc, qsl, ctx, tables, 0.125),
                               **TOL[torch.float32])


def test_paged_attention_rejects_a_table_entry_outside_the_cache():
    q, kc, vc, qsl, ctx, tables = _paged([(20, 1)], 4, 2, 64, torch.float32)
    tables[0, 1] = kc.shape[0]                           # position 16..19 now point past the cache
    with pytest.raises(RuntimeError, match="outside the cache's"):
        pagedserve.paged_attention(q, kc, vc, qsl, ctx, tables, 0.125)


def test_paged_attention_kernel_checks_decode_rows_lengths():
    """Decode-only batches are checked by the kernel itself (no walk over the rows in Python): a context
    past the table's positions, or row starts past q, raise the typed error that names the row."""
    q, kc, vc, qsl, ctx, tables = _paged([(20, 1), (9, 1)], 4, 2, 64, torch.float32)
    positions = tables.shape[1] * kc.shape[1]
    with pytest.raises(ops.OpInputError, match=rf"row 1: .*context_lens \({positions + 1}\) <= max_blocks"):
        pagedserve.paged_attention(q, kc, vc, qsl, torch.tensor([20, positions + 1], dtype=torch.int32), tables,
                                   0.125)
    with pytest.raises(ops.OpInputError, match="end at most at T=2"):
        pagedserve.paged_attention(q, kc, vc, torch.tensor([0, 1, 3], dtype=torch.int32), ctx, tables, 0.125)
    out, prefill = ops.cpu._lib.paged_attention_decode(q, kc, vc, qsl, ctx, tables, 0.125)
    assert prefill == 0
    torch.testing.assert_close(out, reference_paged_attention(q, kc, vc, qsl, ctx, tables, 0.125), **TOL[torch.float32])
    bad = torch.tensor([20, positions + 1], dtype=torch.int32)
    out, prefill = ops.cpu._lib.paged_attention_decode(q, kc, vc, qsl, bad, tables, 0.125)
    assert prefill == -1 and not out.any()          # refused: nothing attended
    q, kc, vc, qsl, ctx, tables = _paged([(20, 1), (9, 3), (30, 2)], 4, 2, 64, torch.float32)
    assert ops.cpu._lib.paged_attention_decode(q, kc, vc, qsl, ctx, tables, 0.125)[1] == 2


def test_long_rows_over_a_cache_in_qs_dtype_go_to_sdpa_where_amx_bf16_runs(monkeypatch):
    """With AMX-BF16, torch's flash SDPA takes rows of more than 64 tokens over a cache in q's dtype; a
    cache narrower than q stays with the kernel. Without AMX-BF16 the AVX-512 kernel takes every row."""
    sets = ops.cpu.INSTRUCTION_SETS
    lifted = "avx512" in sets and "amx_bf16" not in sets
    assert ops.cpu.SAME_DTYPE_ROW_TOKENS == (2**31 - 1 if lifted else 64)
    monkeypatch.setattr(ops.cpu, "KERNEL_ROW_TOKENS", 2**31 - 1)
    monkeypatch.setattr(ops.cpu, "SAME_DTYPE_ROW_TOKENS", 64)
    monkeypatch.setattr(ops.cpu, "LANES_ROW_TOKENS", 2**31 - 1)     # its own test: test_prefill_attention.py
    sdpa_rows = []
    real = ops.cpu._prefill_row
    monkeypatch.setattr(ops.cpu, "_prefill_row", lambda *a: sdpa_rows.append(a[5]) or real(*a))   # a[5]: its tokens
    q, kc, vc, qsl, ctx, tables = _paged([(100, 70), (64, 64), (9, 1)], 4, 2, 64, torch.bfloat16)
    for query in (q, q.float()):        # the cache in q's dtype, then narrower than q: no SDPA
        got = pagedserve.paged_attention(query, kc, vc, qsl, ctx, tables, 0.125)
        want = reference_paged_attention(query, kc, vc, qsl, ctx, tables, 0.125)
        torch.testing.assert_close(got, want, **TOL[query.dtype])
    assert sdpa_rows == [70]


def test_paged_attention_kernel_with_prefill_rows_only():
    """A call whose every row is longer than max_tokens (a prefill-only step on CPUs where long rows go to
    SDPA) attends nothing and counts the rows for the caller; it once read past its empty list of decode rows."""
    q, kc, vc, qsl, ctx, tables = _paged([(20, 6), (9, 3)], 4, 2, 64, torch.float32)
    out, prefill = ops.cpu._lib.paged_attention_decode(q, kc, vc, qsl, ctx, tables, 0.125, 0, 0, 2)
    assert prefill == 2 and not out.any()
    torch.testing.assert_close(pagedserve.paged_attention(q, kc, vc, qsl, ctx, tables, 0.125),
                               reference_paged_attention(q, kc, vc, qsl, ctx, tables, 0.125), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_matches_reference_and_skips_padding(dtype):
    g = torch.Generator().manual_seed(3)
    k_cache = torch.randn(6, 16, 4, 64, generator=g).to(dtype)[:, :, 1:3]      # strided views of wider caches
    v_cache = torch.randn(6, 16, 4, 64, generator=g).to(dtype)[:, :, 1:3]
    k, v = torch.randn(7, 2, 64, generator=g).to(dtype), torch.randn(7, 2, 64, generator=g).to(dtype)
    slots = torch.tensor([95, -1, 0, 15, 16, -1, 47])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference_write_kv(want_k, want_v, k, v, slots)
    pagedserve.write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert torch.equal(k_cache[5, 15], k[0]) and torch.equal(v_cache[1, 0], v[4])   # 95 = 5*16+15, 16 = 1*16+0


def test_write_kv_rejects_a_slot_past_the_cache_and_writes_nothing():
    cache = torch.zeros(2, 16, 1, 8)
    with pytest.raises(ops.OpInputError, match="slot 32 is past the cache's last slot 31"):
        pagedserve.write_kv(cache, cache.clone(), torch.ones(2, 1, 8), torch.ones(2, 1, 8), torch.tensor([3, 32]))
    assert not cache.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, rotary_dim", [(64, 64), (128, 128), (128, 32)])
def test_rotary_equals_the_torch_body_bit_for_bit(dtype, head_dim, rotary_dim):
    g = torch.Generator().manual_seed(head_dim + rotary_dim)
    q = (torch.randn(11, 8, head_dim, generator=g) * 4).to(dtype)
    k = (torch.randn(11, 2, head_dim, generator=g) * 4).to(dtype)
    positions = torch.randint(0, 4096, (11,), generator=g)
    table = rope_cos_sin(4096, rotary_dim, 1e6)
    got = pagedserve.rotary(q, k, positions, table, rotary_dim)
    for a, b in zip(got, torch_rotary(q, k, positions, table, rotary_dim)):
        assert torch.equal(a, b)
    for a, b in zip(got, reference_rotary(q, k, positions, table, rotary_dim)):
        torch.testing.assert_close(a, b, **TOL[dtype])


def test_rotary_rejects_a_position_past_the_table():
    q, k = torch.randn(2, 2, 16), torch.randn(2, 1, 16)
    with pytest.raises(ops.OpInputError, match=r"positions must lie in \[0, 8\).*got 8"):
        pagedserve.rotary(q, k, torch.tensor([1, 8]), rope_cos_sin(8, 16, 1e4), 16)


def test_failed_build_logs_one_line_and_keeps_the_torch_bodies(monkeypatch, caplog):
    def no_compiler():
        raise RuntimeError("Error building extension 'pagedserve_cpu': g++: not found\nmore compiler output")

    monkeypatch.setattr(ops.cpu, "_lib", None)
    monkeypatch.setattr(ops.cpu.build, "load_extension", no_compiler)
    with caplog.at_level(logging.WARNING, logger="ops.cpu"):
        assert ops.cpu.install() is False
    [record] = caplog.records
    assert "C++ CPU kernels unavailable" in record.getMessage() and "g++: not found" in record.getMessage()
    assert "\n" not in record.getMessage()
    for op, body in ops.cpu.TORCH_BODIES.items():
        assert _registry.impl(op, CPU) is body
    q, kc, vc, qsl, ctx, tables = _paged([(17, 1), (9, 3)], 4, 2, 64, torch.float32)
    torch.testing.assert_close(pagedserve.paged_attention(q, kc, vc, qsl, ctx, tables, 0.125),
                               reference_paged_attention(q, kc, vc, qsl, ctx, tables, 0.125), **TOL[torch.float32])


def test_switch_off_skips_the_build(monkeypatch, caplog):
    monkeypatch.setenv(ops.cpu.ENV_SWITCH, "0")
    monkeypatch.setattr(ops.cpu.build, "load_extension", lambda: pytest.fail("the switch did not skip the build"))
    with caplog.at_level(logging.WARNING, logger="ops.cpu"):
        assert ops.cpu.install() is False
    assert not caplog.records
    assert _registry.impl("paged_attention", CPU) is ops.cpu.TORCH_BODIES["paged_attention"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_kernels_match_reference_on_many_and_strided_rows(dtype):
    """40 rows (several threads' chunks) taken as a strided view, as the q/k norms get them from the
    fused q/k/v projection."""
    g = torch.Generator().manual_seed(11)
    fused = torch.randn(40, 3 * 128, generator=g).to(dtype)
    x = fused[:, :256].reshape(40, 2, 128)              # not contiguous
    residual, w = torch.randn(40, 2, 128, generator=g).to(dtype), torch.randn(128, generator=g).to(dtype)
    torch.testing.assert_close(pagedserve.rms_norm(x, w, 1e-6), reference_rms_norm(x, w, 1e-6), **TOL[dtype])
    normed, summed = pagedserve.add_rms_norm(x, residual, w, 1e-6)
    want_normed, want_summed = reference_add_rms_norm(x, residual, w, 1e-6)
    assert torch.equal(summed, want_summed)
    torch.testing.assert_close(normed, want_normed, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_rounds_where_the_torch_body_does(dtype):
    """Rows of 4,867 values (vectors, then a tail of lanes the scalar code takes) and 9 rows (several
    threads' shares), from a strided view, with values where exp over- or underflows, zeros and a NaN. The
    exp differs from torch's in the last bits of fp32, which a bf16 result rounds away but for a few ties."""
    g = torch.Generator().manual_seed(12)
    fused = (torch.randn(9, 3 * 4867, generator=g) * 6).to(dtype)
    x = fused[:, :2 * 4867]                             # not contiguous
    x[0, :5] = torch.tensor([100.0, -100.0, 0.0, -0.0, 89.0])
    x[1, 7] = float("nan")
    out, want = pagedserve.silu_and_mul(x), torch_silu_and_mul(x)
    assert out.shape == want.shape == (9, 4867) and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-6, atol=0, equal_nan=True)
        return
    same = (out == want) | (out.isnan() & want.isnan())
    assert float(same.float().mean()) > 0.995
    torch.testing.assert_close(out[~same].float(), want[~same].float(), rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(1, 40), (7, 37), (33, 256), (130, 1100)])
def test_dense_linear_matches_float64_on_decode_sized_batches(dtype, n, k):
    """W row counts off the 3-row tiles (the last row repeated), K off the 8- and 16-wide steps, and 0 to
    SMALL_ROWS + 1 rows: partial 4-row blocks of x, and the last goes to F.linear."""
    g = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=g).to(dtype)
    for m in (0, 1, 2, 3, 4, 5, 8, 17, 34, SMALL_ROWS, SMALL_ROWS + 1):
        x = torch.randn(m, k, generator=g).to(dtype)
        got = pagedserve.dense_linear(x, weight)
        want = (x.double() @ weight.double().T).to(dtype)
        assert got.shape == (m, n) and got.dtype == dtype
        scale = float(want.float().abs().max()) if m else 1.0     # sums of K products: relative to the largest
        torch.testing.assert_close(got.float() / scale, want.float() / scale, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_linear_row_is_the_same_bits_in_any_batch(dtype):
    """A row's outputs do not depend on the rows beside it (where it falls in the 4-row blocks): a decode
    step alone and the same token in a speculative verify row or a larger batch get one result."""
    g = torch.Generator().manual_seed(5)
    weight, x = torch.randn(37, 200, generator=g).to(dtype), torch.randn(9, 200, generator=g).to(dtype)
    alone = torch.cat([pagedserve.dense_linear(x[i:i + 1], weight) for i in range(9)])
    for m in range(2, 10):
        for start in range(0, 9 - m + 1):
            assert torch.equal(pagedserve.dense_linear(x[start:start + m], weight), alone[start:start + m]), (m, start)


def test_dense_linear_uses_the_kernel_only_where_it_applies(monkeypatch):
    weight, x = torch.randn(24, 64), torch.randn(3, 64)
    calls = []
    real = ops.cpu._lib.dense_linear
    monkeypatch.setattr(ops.cpu, "_lib", type("Lib", (), {"dense_linear": staticmethod(
        lambda *a: calls.append(a[0].shape[0]) or real(*a))})())
    ops.cpu.cpp_dense_linear(x, weight)
    ops.cpu.cpp_dense_linear(torch.randn(SMALL_ROWS + 1, 64), weight)      # a prefill chunk: MKL
    ops.cpu.cpp_dense_linear(x, torch.randn(64, 24).T)                      # a strided weight: no copy per call
    ops.cpu.cpp_dense_linear(x.double(), weight.double())                   # a dtype the kernel lacks
    assert calls == [3]


def test_dense_linear_rejects_mismatched_inputs():
    with pytest.raises(ops.OpInputError, match="same K"):
        pagedserve.dense_linear(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(ops.OpInputError, match="share one floating dtype"):
        pagedserve.dense_linear(torch.randn(2, 8), torch.randn(4, 8).bfloat16())
    torch.library.opcheck(torch.ops.pagedserve.dense_linear.default, (torch.randn(3, 40), torch.randn(7, 40)))
