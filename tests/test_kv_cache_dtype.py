"""K/V stored in a 16-bit dtype or block-quantized (kv_cache_dtype) under fp32 or bf16 activations: write_kv
converts (or quantizes) on write, paged_attention widens (or dequantizes) on read, against a float64
reference on the K/V as stored. The C++ decode kernel is checked on every code path this CPU has: head_dim
128 and 64 take the widest vectors (AVX-512 here), 48 the AVX2 code on an AVX-512 CPU, 40 the scalar code
(quantized rows, whose head_dims are multiples of 32, cap the vector width through the kernel's `lanes`);
bf16 queries on a bf16 cache take the bf16 dot products where AVX-512 BF16 exists. Long rows are cut into
pieces (more than there are threads), and a row comes out the same bit for bit whatever the batch."""
from __future__ import annotations

import pytest
import torch

import ops
import ops.cpu
from ops import kv_quant
import ops.paged_attention as attention
from ops.paged_attention import gather_kv, reference_paged_attention
from ops.write_kv import reference_write_kv

pagedserve = torch.ops.pagedserve
KV_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
QUANT = list(kv_quant.FORMATS)
# bf16 outputs are rounded to bf16 (and the bf16 dot products round the softmax weights to bf16, and
# dequantized K/V values, and the rotated queries of a quantized cache)
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
QUANT_BF16_TOL = dict(atol=4e-2, rtol=2e-2)


# The C++ decode kernel scores quantized caches with integer dot products where it is built with AVX-512 VNNI
# (ops/cpu/attention_int8.h) or for the AVX2 set (attention_int16.h): queries quantized like q8_0 keys
# (kv_quant.int8_queries), values weighed in 16-bit steps of a chunk's largest block scale (VNNI: q8_0 / 65535,
# q4_0 / 16383; AVX2: / 32767). Outputs are within ~1e-4 of the float64 attention of those queries (measured up to 4e-4
# on outputs of size ~1; 8-bit weights measured up to 4e-2, past this tolerance).
AVX512 = "avx512" in ops.cpu.INSTRUCTION_SETS           # what the kernels were built for, not the CPU
INT8_DOTS = "avx512_vnni" in ops.cpu.INSTRUCTION_SETS
INT8_TOL = dict(atol=1e-3, rtol=1e-4)


def tol(q_dtype, kv_dtype) -> dict:
    return QUANT_BF16_TOL if isinstance(kv_dtype, str) and q_dtype == torch.bfloat16 else TOL[q_dtype]


def decode_tol(q_dtype, kv_dtype, int8: bool) -> dict:
    """tol, or INT8_TOL for fp32 queries where the integer dot products served them."""
    return INT8_TOL if int8 and q_dtype == torch.float32 else tol(q_dtype, kv_dtype)


def int8_served(kv_dtype, lanes: int = 0, head_dim: int = 64) -> bool:
    """Whether the decode kernel serves a call with integer dot products against int8-rounded queries:
    quantized caches on the widest set with AVX-512 VNNI (head_dim up to 256), and on the AVX2 set (lanes 8,
    or any lanes but the scalar 1 where there is no AVX-512)."""
    if not isinstance(kv_dtype, str):
        return False
    if INT8_DOTS and lanes == 0 and head_dim <= 256:
        return True
    return lanes == 8 or (lanes != 1 and not AVX512)


def op_reference(q, k_cache, v_cache, qsl, ctx, tables, scale, int8: bool):
    """reference_paged_attention, from the integer kernel's queries where `int8` for the rows the C++
    kernel serves (up to ops.cpu.KERNEL_ROW_TOKENS new tokens; longer ones go through SDPA on q)."""
    want = reference_paged_attention(q, k_cache, v_cache, qsl, ctx, tables, scale)
    if int8:
        served = [t for i in range(len(ctx)) if qsl[i + 1] - qsl[i] <= ops.cpu.KERNEL_ROW_TOKENS
                  for t in range(int(qsl[i]), int(qsl[i + 1]))]
        want[served] = reference_paged_attention(kv_quant.int8_queries(q).to(q.dtype), k_cache, v_cache, qsl, ctx,
                                                 tables, scale)[served]
    return want


BLOCK = 16

pytestmark = pytest.mark.usefixtures("cpp_kernels")


def empty_cache(num_blocks, block, kv_heads, head_dim, kv_dtype):
    """Zero K/V caches of a storage dtype or a quantized format's name (uint8 rows)."""
    if isinstance(kv_dtype, str):
        return (torch.zeros(num_blocks, block, kv_heads, kv_quant.row_bytes(kv_dtype, head_dim), dtype=torch.uint8)
                for _ in range(2))
    return (torch.zeros(num_blocks, block, kv_heads, head_dim, dtype=kv_dtype) for _ in range(2))


def stored(k_cache, v_cache, head_dim):
    """The caches' K/V as values in float64, quantized ones dequantized and K rotated back."""
    fmt = kv_quant.format_of(k_cache, head_dim)
    if fmt is None:
        return k_cache.double(), v_cache.double()
    keys, values = kv_quant.dequantize_kv(k_cache, v_cache, fmt, torch.float64)
    return kv_quant.rotate(keys), values


def _batch(rows, group, head_dim, q_dtype, kv_dtype, *, kv_heads=2, block=BLOCK, seed=0):
    """rows = [(context_len, new_tokens)]: shuffled blocks, table entries past a row's context junk, every
    position's K/V written through pagedserve.write_kv from q_dtype rows into kv_dtype caches (a dtype or a
    quantized format's name)."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-ctx // block) for ctx, _ in rows) + 1
    num_blocks = len(rows) * width + 1
    tables = torch.randperm(num_blocks, generator=g)[: len(rows) * width].view(len(rows), width).int()
    for i, (ctx, _) in enumerate(rows):
        tables[i, -(-ctx // block):] = num_blocks + 3
    k_cache, v_cache = empty_cache(num_blocks, block, kv_heads, head_dim, kv_dtype)
    slots = torch.tensor([int(tables[i, p // block]) * block + p % block for i, (ctx, _) in enumerate(rows)
                          for p in range(ctx)])
    k = (torch.randn(len(slots), kv_heads, head_dim, generator=g) * 2).to(q_dtype)
    v = torch.randn(len(slots), kv_heads, head_dim, generator=g).to(q_dtype)
    pagedserve.write_kv(k_cache, v_cache, k, v, slots)
    q = torch.randn(sum(n for _, n in rows) + 2, kv_heads * group, head_dim, generator=g).to(q_dtype)
    qsl = torch.tensor([0] + [sum(n for _, n in rows[: i + 1]) for i in range(len(rows))], dtype=torch.int32)
    return q, k_cache, v_cache, qsl, torch.tensor([c for c, _ in rows], dtype=torch.int32), tables


def _decode_reference(q, k_cache, v_cache, qsl, ctx, tables, scale, max_tokens=1):
    """Float64 attention of each token of the rows of at most `max_tokens` new tokens over the positions it
    sees (causal: the cached ones and its row's earlier tokens); vectorised, for long rows."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group, block = q.shape[1] // k_cache.shape[2], k_cache.shape[1]
    k_cache, v_cache = stored(k_cache, v_cache, q.shape[2])
    for i, n_ctx in enumerate(ctx.tolist()):
        n = int(qsl[i + 1] - qsl[i])
        if not 1 <= n <= max_tokens:
            continue
        blocks = tables[i, : -(-n_ctx // block)].long()
        keys = k_cache[blocks].flatten(0, 1)[:n_ctx].repeat_interleave(group, dim=1)    # [ctx, Hq, D]
        values = v_cache[blocks].flatten(0, 1)[:n_ctx].repeat_interleave(group, dim=1)
        for j in range(n):
            seen, t = n_ctx - n + j + 1, int(qsl[i]) + j
            weights = torch.softmax(torch.einsum("hd,chd->hc", q[t].double(), keys[:seen]) * scale, dim=-1)
            out[t] = torch.einsum("hc,chd->hd", weights, values[:seen])
    return out


# decode rows on both sides of block boundaries, a 1-token context, a fresh prefill, a chunk after a prefix
RAGGED = [(15, 1), (16, 1), (17, 1), (1, 1), (33, 1), (20, 20), (40, 7), (64, 1)]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group, head_dim", [(1, 128), (6, 128), (12, 128), (3, 64), (4, 48), (2, 40)])
def test_paged_attention_reads_the_cache_as_stored(q_dtype, kv_dtype, group, head_dim):
    q, kc, vc, qsl, ctx, tables = _batch(RAGGED, group, head_dim, q_dtype, kv_dtype, seed=group + head_dim)
    assert kc.dtype == kv_dtype
    scale = head_dim ** -0.5
    got = pagedserve.paged_attention(q, kc, vc, qsl, ctx, tables, scale)
    assert got.dtype == q_dtype and got.shape == q.shape
    torch.testing.assert_close(got, reference_paged_attention(q, kc, vc, qsl, ctx, tables, scale), **TOL[q_dtype])
    assert not got[int(qsl[-1]):].any()                   # padding tokens stay zero


@pytest.mark.parametrize("kv_dtype", KV_DTYPES + QUANT)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pieces", [1, 3, 7, 64])
def test_long_rows_cut_into_pieces_match_one_pass(q_dtype, kv_dtype, pieces):
    """One long row alone, then long and short rows together, then verify rows (a few new tokens after a
    long context, attended token by token), cut into `pieces` pieces (more than there are threads, at
    odd block counts): the merged softmax equals the uncut one. The 4-token row is left
    to the caller in the first two."""
    for rows, max_tokens in (([(1000, 1)], 1), ([(700, 1), (5, 1), (30, 4), (333, 1), (16, 1)], 1),
                             ([(900, 6), (5, 1), (300, 3)], 6)):
        q, kc, vc, qsl, ctx, tables = _batch(rows, 6, 128, q_dtype, kv_dtype, seed=pieces)
        got, _ = ops.cpu._lib.paged_attention_decode(q, kc, vc, qsl, ctx, tables, 0.0883, pieces, 0,
                                                     max_tokens)
        int8 = int8_served(kv_dtype)
        want = _decode_reference(kv_quant.int8_queries(q) if int8 else q, kc, vc, qsl, ctx, tables, 0.0883,
                                 max_tokens)
        decode = [int(qsl[i]) + j for i, (_, n) in enumerate(rows) if n <= max_tokens for j in range(n)]
        torch.testing.assert_close(got[decode].double(), want[decode], **decode_tol(q_dtype, kv_dtype, int8))
        assert not got[[t for t in range(q.shape[0]) if t not in decode]].any()   # the kernel's rows only


@pytest.mark.parametrize("kv_dtype", KV_DTYPES + QUANT)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pieces", [0, 3])
@pytest.mark.parametrize("lanes", [0, 8])
def test_a_row_is_attended_the_same_bit_for_bit_whatever_the_batch(q_dtype, kv_dtype, pieces, lanes):
    """Greedy output with speculation equals plain decoding only if a verify row's token gets exactly the
    attention a decode step would give it: each token of a 5-token row over a 700-token context, attended
    alone as a decode row, equals the same token in the verify row beside other rows (where rows are cut
    into pieces must not depend on the batch). So does each token of a 37-token prefill chunk, whose tokens
    the kernel reads together in groups of as many blocks (here 4 groups, one of a single token)."""
    rows = [(300, 1), (700, 5), (1000, 1), (689, 37)]
    q, kc, vc, qsl, ctx, tables = _batch(rows, 6, 128, q_dtype, kv_dtype, seed=11)
    batched, _ = ops.cpu._lib.paged_attention_decode(q, kc, vc, qsl, ctx, tables, 0.0883, pieces, lanes, 37)
    for row in (1, 3):
        n = rows[row][1]
        for j in range(n):
            token = int(qsl[row]) + j
            alone, _ = ops.cpu._lib.paged_attention_decode(
                q[token:token + 1].contiguous(), kc, vc, torch.tensor([0, 1], dtype=torch.int32),
                torch.tensor([rows[row][0] - n + 1 + j], dtype=torch.int32), tables[row:row + 1].contiguous(),
                0.0883, pieces, lanes)
            assert torch.equal(alone[0], batched[token]), (row, j)


# quantized caches keep tiles of 16 slots, so their blocks are multiples of 16 (tests/test_kv_quant.py: refused)
@pytest.mark.parametrize("kv_dtype, block", [(torch.bfloat16, 8), (torch.bfloat16, 32), ("q4_0", 32), ("q8_0", 64)])
def test_block_sizes_other_than_the_tile(block, kv_dtype):
    """Blocks smaller than the 16-position tile, and blocks of two or four tiles."""
    rows = [(block - 1, 1), (block + 3, 1), (5 * block, 1), (3 * block, 2)]
    q, kc, vc, qsl, ctx, tables = _batch(rows, 6, 64, torch.float32, kv_dtype, block=block, seed=block)
    got = pagedserve.paged_attention(q, kc, vc, qsl, ctx, tables, 0.125)
    int8 = int8_served(kv_dtype)
    torch.testing.assert_close(got, op_reference(q, kc, vc, qsl, ctx, tables, 0.125, int8),
                               **decode_tol(torch.float32, kv_dtype, int8))


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_write_kv_rounds_like_tensor_to(src_dtype, kv_dtype):
    """The C++ body stores the bits `Tensor.to` gives (round to nearest even), into strided caches."""
    g = torch.Generator().manual_seed(5)
    k_cache = torch.zeros(4, BLOCK, 4, 64, dtype=kv_dtype)[:, :, 1:3]
    v_cache = torch.zeros(4, BLOCK, 4, 64, dtype=kv_dtype)[:, :, 1:3]
    k = (torch.randn(5, 2, 64, generator=g) * 100).to(src_dtype)
    v = torch.randn(5, 2, 64, generator=g).to(src_dtype)
    slots = torch.tensor([63, -1, 0, 16, 17])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference_write_kv(want_k, want_v, k, v, slots)
    pagedserve.write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert torch.equal(k_cache[3, 15], k[0].to(kv_dtype))


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, *QUANT])
def test_the_torch_bodies_read_a_narrower_cache_too(kv_dtype):
    """Without the C++ kernels (no compiler): the torch decode and prefill bodies widen a bf16 cache and
    dequantize a quantized one."""
    q, kc, vc, qsl, ctx, tables = _batch(RAGGED, 4, 64, torch.float32, kv_dtype)
    ops.cpu.use_backend("torch")
    got = pagedserve.paged_attention(q, kc, vc, qsl, ctx, tables, 0.125)
    torch.testing.assert_close(got, reference_paged_attention(q, kc, vc, qsl, ctx, tables, 0.125),
                               **TOL[torch.float32])


@pytest.mark.parametrize("fmt", QUANT)
@pytest.mark.parametrize("block", [16, 32])
def test_the_gather_kernel_dequantizes_to_the_torch_bodys_bits(fmt, block):
    """gather_kv.cpp, what a long prefill row's SDPA reads: the blocks in any order, repeated too, dequantized
    to gather_kv's bits in bf16 and fp32 (K still rotated); a block past the cache is refused."""
    _, kc, vc, _, _, tables = _batch([(70, 1), (50, 1)], 1, 128, torch.float32, fmt, block=block, seed=5)
    blocks = torch.cat((tables[1, :2], tables[0, :3], tables[1, :1])).long()
    for dtype in (torch.bfloat16, torch.float32):
        got, want = ops.cpu.cpp_gather_kv(kc, vc, blocks, dtype, 128), gather_kv(kc, vc, blocks, dtype, 128)
        assert got[0].dtype == dtype and got[0].shape == (6, block, 2, 128)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(RuntimeError, match=f"block {kc.shape[0]} is not in the cache"):
        ops.cpu._lib.gather_kv(kc, vc, torch.tensor([0, kc.shape[0]]), 128, True)


def test_long_chunks_after_a_long_quantized_prefix_go_to_sdpa_where_amx_bf16_runs(monkeypatch):
    """Where AMX-BF16 runs, a row of QUANT_SDPA_TOKENS new tokens or more after SPLIT_PREFIX cached ones over a
    quantized cache is attended by SDPA on the prefix dequantized, exactly; shorter rows keep the kernel, and
    so does every row of a call where such a row follows a shorter prefix."""
    assert ops.cpu.QUANT_SDPA_TOKENS == (256 if "amx_bf16" in ops.cpu.INSTRUCTION_SETS else 2**31 - 1)
    monkeypatch.setattr(ops.cpu, "KERNEL_ROW_TOKENS", 2**31 - 1)
    monkeypatch.setattr(ops.cpu, "QUANT_SDPA_TOKENS", 20)
    monkeypatch.setattr(attention, "SPLIT_PREFIX", 40)
    real = ops.cpu._prefill_row
    for fmt in QUANT:
        for rows, routed in (([(100, 37), (45, 5), (64, 1)], [37]), ([(100, 37), (30, 30), (64, 1)], [])):
            sdpa_rows = []
            monkeypatch.setattr(ops.cpu, "_prefill_row", lambda *a: sdpa_rows.append(a[5]) or real(*a))
            q, kc, vc, qsl, ctx, tables = _batch(rows, 6, 128, torch.float32, fmt, seed=3)
            got = pagedserve.paged_attention(q, kc, vc, qsl, ctx, tables, 0.0883)
            want = op_reference(q, kc, vc, qsl, ctx, tables, 0.0883, int8_served(fmt))
            exact = reference_paged_attention(q, kc, vc, qsl, ctx, tables, 0.0883)
            for i, (_, n) in enumerate(rows):
                tokens = slice(int(qsl[i]), int(qsl[i + 1]))
                torch.testing.assert_close(got[tokens], (exact if n in routed else want)[tokens],
                                           **decode_tol(torch.float32, fmt, n not in routed and int8_served(fmt)))
            assert sdpa_rows == routed


def test_caches_of_different_or_unsupported_dtypes_are_refused():
    q, kc, vc, qsl, ctx, tables = _batch([(17, 1)], 2, 64, torch.float32, torch.bfloat16)
    with pytest.raises(ops.OpInputError, match=r"one K/V storage dtype \(float32, bfloat16, float16\)"):
        pagedserve.paged_attention(q, kc, vc.half(), qsl, ctx, tables, 0.125)
    with pytest.raises(ops.OpInputError, match="got torch.int8 and torch.int8"):
        pagedserve.write_kv(kc.to(torch.int8), vc.to(torch.int8), q[:1, :2], q[:1, :2], torch.tensor([0]))


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16, *QUANT])
def test_opcheck_with_a_narrower_cache(kv_dtype):
    q, kc, vc, qsl, ctx, tables = _batch(RAGGED, 2, 64, torch.float32, kv_dtype)
    torch.library.opcheck(pagedserve.paged_attention.default, (q, kc, vc, qsl, ctx, tables, 0.125))
    new = torch.randn(3, 2, 64)
    torch.library.opcheck(pagedserve.write_kv.default, (kc.clone(), vc.clone(), new, new * 2,
                                                        torch.tensor([3, -1, 40])))


def test_the_config_key_offers_exactly_the_pool_choices():
    from engine.config import EngineConfig
    from engine.kv.pool import KV_CACHE_DTYPE_CHOICES

    field = EngineConfig.__dataclass_fields__["kv_cache_dtype"]
    assert field.metadata["choices"] == KV_CACHE_DTYPE_CHOICES
