"""ops/cpu/prefill_attention.cpp: prefill rows over a bf16 cache with 16 tokens to a vector (AVX-512 BF16),
against the float64 reference, and the dispatch that sends long bf16 rows to it."""
from __future__ import annotations

import pytest
import torch

import ops.cpu
from ops.paged_attention import reference_paged_attention
from test_cpu_kernels import TOL, _paged

pagedserve = torch.ops.pagedserve

pytestmark = [pytest.mark.usefixtures("cpp_kernels"),
              pytest.mark.skipif("avx512_bf16" not in ops.cpu.INSTRUCTION_SETS,
                                 reason="prefill_attention.cpp is built for AVX-512 BF16 only")]


def _one_row(q, kc, vc, qsl, ctx, tables, i):
    start, end = int(qsl[i]), int(qsl[i + 1])
    return ops.cpu._lib.prefill_attention(q[start:end].contiguous(), kc, vc, tables[i], int(ctx[i]), 0.3)


# head_dim 32-256; groups of 1, 6 (four keys a pass), 7 (three) and 10 query heads per kv head (two passes:
# 8 + 2); rows of 1 to 70 tokens (lanes of 16 and a ragged last one), fresh or after a prefix, odd and even
# positions per step.
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("group", [1, 6, 7, 10])
@pytest.mark.parametrize("block", [16, 32])
def test_prefill_attention_matches_the_reference(head_dim, group, block):
    rows = [(70, 70), (37 + 17, 17), (200 + 33, 33), (1, 1), (130, 2)]
    q, kc, vc, qsl, ctx, tables = _paged(rows, 2 * group, 2, head_dim, torch.bfloat16, block=block,
                                         seed=head_dim + group)
    want = reference_paged_attention(q, kc, vc, qsl, ctx, tables, 0.3)
    for i in range(len(rows)):
        got = _one_row(q, kc, vc, qsl, ctx, tables, i)
        assert got.dtype == torch.bfloat16 and got.shape == (rows[i][1], 2 * group, head_dim)
        torch.testing.assert_close(got, want[int(qsl[i]):int(qsl[i + 1])], **TOL[torch.bfloat16])


def test_prefill_attention_with_strided_caches():
    q, kc, vc, qsl, ctx, tables = _paged([(90, 40)], 12, 2, 128, torch.bfloat16, head_slice=True)
    assert not kc.is_contiguous()
    torch.testing.assert_close(_one_row(q, kc, vc, qsl, ctx, tables, 0),
                               reference_paged_attention(q, kc, vc, qsl, ctx, tables, 0.3), **TOL[torch.bfloat16])


def test_prefill_attention_refuses_what_it_cannot_read():
    q, kc, vc, qsl, ctx, tables = _paged([(40, 20)], 4, 2, 64, torch.bfloat16)
    with pytest.raises(RuntimeError, match="block 99 is not in the cache"):
        ops.cpu._lib.prefill_attention(q, kc, vc, torch.tensor([0, 99, 1], dtype=torch.int32), 40, 0.3)
    with pytest.raises(RuntimeError, match="bf16 q"):
        ops.cpu._lib.prefill_attention(q.float(), kc, vc, tables[0], 40, 0.3)
    q, kc, vc, qsl, ctx, tables = _paged([(40, 20)], 4, 2, 40, torch.bfloat16)
    with pytest.raises(RuntimeError, match="D 32, 64, 128 or 256"):
        ops.cpu._lib.prefill_attention(q, kc, vc, tables[0], 40, 0.3)


class _Spy:
    """ops.cpu._lib with the prefill_attention calls' row lengths recorded."""

    def __init__(self, lib):
        self.lib, self.rows = lib, []

    def __getattr__(self, name):
        return getattr(self.lib, name)

    def prefill_attention(self, q, *args):
        self.rows.append(q.shape[0])
        return self.lib.prefill_attention(q, *args)


def test_long_bf16_rows_go_to_prefill_attention_where_avx512_bf16_runs_without_amx(monkeypatch):
    """Rows of more than LANES_ROW_TOKENS new tokens, bf16 q over a bf16 cache: 64 where the CPU has AVX-512
    BF16 and no AMX (with AMX they go to SDPA). Shorter rows, other dtypes and other head sizes keep the
    kernel."""
    amx = "amx_bf16" in ops.cpu.INSTRUCTION_SETS
    assert ops.cpu.LANES_ROW_TOKENS == (2**31 - 1 if amx else 64)
    monkeypatch.setattr(ops.cpu, "KERNEL_ROW_TOKENS", 2**31 - 1)
    monkeypatch.setattr(ops.cpu, "SAME_DTYPE_ROW_TOKENS", 2**31 - 1)
    monkeypatch.setattr(ops.cpu, "LANES_ROW_TOKENS", 20)
    spy = _Spy(ops.cpu._lib)
    monkeypatch.setattr(ops.cpu, "_lib", spy)
    rows = [(100, 70), (9, 1), (64, 20), (40, 21)]
    for head_dim, dtype, lanes in [(64, torch.bfloat16, [70, 21]), (64, torch.float32, []),
                                   (40, torch.bfloat16, [])]:
        spy.rows.clear()
        q, kc, vc, qsl, ctx, tables = _paged(rows, 6, 2, head_dim, dtype)
        for query in (q, q.float()):       # bf16 q, then fp32 q over the same cache: the kernel
            got = pagedserve.paged_attention(query, kc, vc, qsl, ctx, tables, 0.125)
            torch.testing.assert_close(got, reference_paged_attention(query, kc, vc, qsl, ctx, tables, 0.125),
                                       **TOL[query.dtype])
        assert spy.rows == lanes
