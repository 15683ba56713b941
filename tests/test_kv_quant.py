"""Block-quantized K/V (kv_cache_dtype q8_0 / q4_0, ops/kv_quant.py): the rotation, the rounding and llama.cpp's
block layouts; write_kv storing the same bytes from the torch body, the C++ kernel and (tests/
test_triton_kernels.py) Triton; paged_attention against a float64 reference on the dequantized K/V with K
rotated back (so the rotation of q is checked too), on every instruction set of the C++ decode kernel
(`lanes` caps the vector width), GQA groups of 1, 2 and 7 heads, page boundaries, ragged rows, prefill rows
after a cached prefix and long rows cut into pieces; keys stored less a constant offset (a k_proj bias's,
engine/models/qwen3.py); the typed errors; the pool's sizes."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from test_kv_cache_dtype import (RAGGED, _batch, _decode_reference, decode_tol, empty_cache, int8_served,
                                 op_reference)

import ops
import ops.cpu
from engine.kv.pool import KVCacheDtypeError, KVPool, KVShape, resolve_kv_cache_dtype
from ops import kv_quant
from ops.rotary import reference_rotary, rope_cos_sin, rotary_mean, torch_rotary
from ops.write_kv import reference_write_kv, torch_write_kv

pagedserve = torch.ops.pagedserve
FORMATS = list(kv_quant.FORMATS)
CPU = torch.device("cpu")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _hadamard() -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 32:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / 32 ** 0.5


def _blocks(seed: int = 0) -> torch.Tensor:
    """Rows of 4 blocks at very different scales (all with normal fp16 scales), an outlier, a zero block."""
    x = torch.randn(64, 128, generator=_gen(seed)) * torch.tensor([1.0, 300.0, 0.05, 5.0]).repeat_interleave(32)
    x[3, 40] = 4000.0
    x[5, :32] = 0.0
    return x


def _scales(rows: torch.Tensor, fmt: str) -> torch.Tensor:
    """Each block's stored fp16 scale, [..., blocks, 1] in fp32."""
    blocks = rows.view(*rows.shape[:-1], -1, kv_quant.BLOCK_BYTES[fmt])
    return blocks[..., :2].contiguous().view(torch.float16).float()


def test_the_rotation_is_the_orthonormal_block_hadamard_transform_and_its_own_inverse():
    x = torch.randn(3, 5, 96, generator=_gen(1), dtype=torch.float64)
    want = (x.view(3, 5, 3, 32) @ _hadamard()).view(3, 5, 96)
    torch.testing.assert_close(kv_quant.rotate(x), want, atol=1e-12, rtol=0)
    torch.testing.assert_close(kv_quant.rotate(kv_quant.rotate(x)), x, atol=1e-12, rtol=0)
    x32 = x.float()
    assert kv_quant.rotate(x32).dtype == torch.float32
    torch.testing.assert_close(kv_quant.rotate(kv_quant.rotate(x32)), x32, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_blocks_are_within_half_a_step(fmt):
    """q8_0: |x - deq(q(x))| <= d/2 everywhere; q4_0: the same, except that the top step (+8d, the side
    opposite the largest magnitude) is clipped to +7d, so values past 7.5d are within d (and the fp16
    rounding of d)."""
    x = _blocks()
    rows = kv_quant.quantize(x, fmt)
    assert rows.dtype == torch.uint8 and rows.shape == (64, kv_quant.row_bytes(fmt, 128))
    d = _scales(rows, fmt)
    x = x.view(64, 4, 32)
    err = (kv_quant.dequantize(rows, fmt).view(64, 4, 32) - x).abs()
    slack = 1e-6 * x.abs().amax(-1, keepdim=True)                     # the fp32 product x * (1 / d)
    bound = d.abs() / 2 + slack
    if fmt == "q4_0":
        bound = torch.where(x / d.where(d != 0, 1) > 7.5, 1.01 * d.abs() + slack, bound)
    assert (err <= bound).all()
    assert not kv_quant.dequantize(rows, fmt).view(64, 4, 32)[5, 0].any()      # zeros stay zeros


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_bytes_are_llama_cpps_block_layouts(fmt):
    """The gguf package (llama.cpp's reference in numpy) reads our rows as we do, and quantizes to the
    same bytes but where its unrounded scale's reciprocal (and q8_0's ties away from zero) differ by a step."""
    x = _blocks(2)
    rows = kv_quant.quantize(x, fmt)
    kind = getattr(gguf.GGMLQuantizationType, fmt.upper())
    theirs = gguf.quants.dequantize(rows.numpy(), kind)
    np.testing.assert_array_equal(theirs, kv_quant.dequantize(rows, fmt).numpy())
    their_rows = torch.from_numpy(gguf.quants.quantize(x.numpy(), kind))
    assert (their_rows == rows).float().mean() > 0.97
    step = _scales(rows, fmt).abs()
    gap = (kv_quant.dequantize(their_rows, fmt) - kv_quant.dequantize(rows, fmt)).view(64, 4, 32).abs()
    assert (gap <= step * 1.01).all()


@pytest.mark.usefixtures("cpp_kernels")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_the_cpp_and_torch_write_kv_store_the_same_bytes(fmt, src_dtype):
    """Padding slots skipped, both sides of a page boundary, a zero row and a block that is all zeros but
    one -0.0 (the scale's sign must agree too); blocks of two tiles."""
    g = _gen(5)
    row = kv_quant.row_bytes(fmt, 64)
    k_cache, v_cache = (torch.zeros(2, 32, 2, row, dtype=torch.uint8) for _ in range(2))
    k = (torch.randn(6, 2, 64, generator=g) * 30).to(src_dtype)
    v = torch.randn(6, 2, 64, generator=g).to(src_dtype)
    k[2], v[2, :, :32] = 0.0, 0.0
    k[3, 0, :32], k[3, 0, 0] = 0.0, -0.0
    slots = torch.tensor([63, -1, 0, 16, 17, 15])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    torch_write_kv(want_k, want_v, k, v, slots)
    pagedserve.write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    ref_k, ref_v = k_cache.clone().zero_(), v_cache.clone().zero_()
    reference_write_kv(ref_k, ref_v, k, v, slots)
    assert torch.equal(ref_k, want_k) and torch.equal(ref_v, want_v)
    # stored rotated: rotating back gives k within the (rotated) rounding error of sqrt(32) * d / 2
    k_row = kv_quant.rows_of(k_cache, fmt, "k")[1, 31]
    torch.testing.assert_close(kv_quant.rotate(kv_quant.dequantize(k_row, fmt)), k[0].float(),
                               atol=3 * _scales(k_row, fmt).abs().max().item(), rtol=0)


@pytest.mark.usefixtures("cpp_kernels")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
# (12: GQA groups past the integer set's 8 heads per pass; 288: past its 256 values per head)
@pytest.mark.parametrize("group, head_dim", [(1, 128), (2, 64), (7, 64), (6, 128), (12, 64), (2, 256), (1, 288)])
# the widest set (integer dot products where the CPU has AVX-512 VNNI), fp32 AVX-512, AVX2, scalar
@pytest.mark.parametrize("lanes", [0, 16, 8, 1])
@pytest.mark.parametrize("max_tokens", [1, 7])      # 7: also the row of 7 new tokens, token by token
def test_decode_rows_on_every_instruction_set(fmt, q_dtype, group, head_dim, lanes, max_tokens):
    q, kc, vc, qsl, ctx, tables = _batch(RAGGED, group, head_dim, q_dtype, fmt, seed=group + head_dim)
    scale = head_dim ** -0.5
    got, prefill = ops.cpu._lib.paged_attention_decode(q, kc, vc, qsl, ctx, tables, scale, 0, lanes, max_tokens)
    assert prefill == sum(n > max_tokens for _, n in RAGGED)
    decode = [int(qsl[i]) + j for i, (_, n) in enumerate(RAGGED) if n <= max_tokens for j in range(n)]
    int8 = int8_served(fmt, lanes, head_dim)
    want = _decode_reference(kv_quant.int8_queries(q) if int8 else q, kc, vc, qsl, ctx, tables, scale, max_tokens)
    torch.testing.assert_close(got[decode].double(), want[decode], **decode_tol(q_dtype, fmt, int8))


@pytest.mark.usefixtures("cpp_kernels")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("lanes", [0, 16, 8, 1])
def test_slots_past_a_rows_end_may_hold_anything(fmt, lanes):
    """A block's slots past every row's end keep whatever the block held before (a reused block): random
    bytes, NaN and infinite scales among them. The kernels read those slots with the tile but must give
    them no weight."""
    rows = [(15, 1), (17, 1), (33, 1), (40, 7)]
    q, kc, vc, qsl, ctx, tables = _batch(rows, 6, 64, torch.float32, fmt, seed=9)
    written = torch.zeros(kc.shape[:2], dtype=torch.bool)
    for i, (n_ctx, _) in enumerate(rows):
        for p in range(n_ctx):
            written[int(tables[i, p // 16]), p % 16] = True
    g = _gen(10)
    for cache, role in ((kc, "k"), (vc, "v")):
        junk = torch.randint(0, 256, cache.shape, generator=g, dtype=torch.uint8)
        scales = junk.view(*cache.shape[:-1], -1, kv_quant.BLOCK_BYTES[fmt])[..., :2]
        scales[..., 0, :] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)      # +inf
        scales[..., 1, :] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)      # NaN
        stored_rows = kv_quant.rows_of(cache, fmt, role)
        stored_rows[~written] = junk[~written]
        cache.copy_(kv_quant.arrange(stored_rows, fmt, role))
    got, _ = ops.cpu._lib.paged_attention_decode(q, kc, vc, qsl, ctx, tables, 0.125, 0, lanes, 7)
    int8 = int8_served(fmt, lanes)
    want = _decode_reference(kv_quant.int8_queries(q) if int8 else q, kc, vc, qsl, ctx, tables, 0.125, 7)
    served = list(range(int(qsl[-1])))
    assert got[served].isfinite().all()
    torch.testing.assert_close(got[served].double(), want[served], **decode_tol(torch.float32, fmt, int8))


@pytest.mark.usefixtures("cpp_kernels")
@pytest.mark.parametrize("backend", ["cpp", "torch"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 7])
def test_the_op_with_decode_and_prefill_rows(backend, fmt, q_dtype, group):
    """Decode rows and prefill rows (a fresh prompt, a chunk after a cached prefix) in one call, through
    the C++ kernel plus SDPA and through the torch body alone."""
    q, kc, vc, qsl, ctx, tables = _batch(RAGGED, group, 64, q_dtype, fmt, seed=group)
    ops.cpu.use_backend(backend)
    got = pagedserve.paged_attention(q, kc, vc, qsl, ctx, tables, 0.125)
    assert got.dtype == q_dtype
    int8 = backend == "cpp" and int8_served(fmt)
    torch.testing.assert_close(got, op_reference(q, kc, vc, qsl, ctx, tables, 0.125, int8),
                               **decode_tol(q_dtype, fmt, int8))
    assert not got[int(qsl[-1]):].any()


@pytest.mark.parametrize("role", kv_quant.ROLES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_tile_holds_its_rows_bytes_where_the_kernels_read_them(fmt, role):
    """The documented arrangement, byte by byte, for slot 19 (tile 1, slot 3 of it) of kv head 1 in blocks
    of 32 slots of 2 heads of 64 values: scales first, then the K order (4 values of each slot side by side)
    or the V order (16 values of 4 slots side by side)."""
    row, tile = kv_quant.row_bytes(fmt, 64), 16 * kv_quant.row_bytes(fmt, 64)
    where = kv_quant.positions(fmt, role, 32, 2, 64)[19, 1]
    start, j = (1 * 2 + 1) * tile, 3                      # head 1's second tile, its slot 3
    block_bytes = kv_quant.BLOCK_BYTES[fmt]
    for b in range(2):
        assert where[b * block_bytes: b * block_bytes + 2].tolist() == [start + (b * 16 + j) * 2 + i for i in range(2)]
    values = start + 2 * 16 * 2
    if fmt == "q8_0":
        value = [b * 32 + u for b in range(2) for u in range(32)]
        want = ([values + v // 4 * 64 + j * 4 + v % 4 for v in value] if role == "k"
                else [values + (v // 16 * 4 + j // 4) * 64 + v % 16 * 4 + j % 4 for v in value])
    else:
        pair = [(b, u) for b in range(2) for u in range(16)]
        want = ([values + b * 256 + u // 4 * 64 + j * 4 + u % 4 for b, u in pair] if role == "k"
                else [values + (b * 4 + j // 4) * 64 + u * 4 + j % 4 for b, u in pair])
    got = [int(where[i]) for i in range(row) if i % block_bytes >= 2]
    assert got == want
    rows = torch.randint(0, 256, (3, 32, 2, row), generator=_gen(8), dtype=torch.uint8)
    assert torch.equal(kv_quant.rows_of(kv_quant.arrange(rows, fmt, role), fmt, role), rows)


def test_quantized_caches_are_refused_with_the_fix():
    q = torch.randn(1, 4, 48)
    kc, vc = (torch.zeros(2, 16, 2, 27, dtype=torch.uint8) for _ in range(2))
    args = (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
            torch.zeros(1, 1, dtype=torch.int32), 0.1)
    with pytest.raises(ops.OpInputError, match="needs head_dim a multiple of 32, got 48"):
        pagedserve.paged_attention(q, kc, vc, *args)
    kc, vc = empty_cache(2, 16, 2, 64, "q8_0")
    with pytest.raises(ops.OpInputError, match=r"34 bytes \(q8_0\) or 18 bytes \(q4_0\) for head_dim 32, got 68"):
        pagedserve.write_kv(kc, vc, torch.randn(1, 2, 32), torch.randn(1, 2, 32), torch.tensor([0]))
    kc, vc = empty_cache(2, 8, 2, 64, "q4_0")
    with pytest.raises(ops.OpInputError, match="kv_cache_dtype q4_0 needs block_size a multiple of 16 .* got 8"):
        pagedserve.write_kv(kc, vc, torch.randn(1, 2, 64), torch.randn(1, 2, 64), torch.tensor([0]))
    kc, vc = (c[:, :, :1] for c in empty_cache(2, 16, 2, 64, "q8_0"))
    with pytest.raises(ops.OpInputError, match="a q8_0 cache must be contiguous"):
        pagedserve.write_kv(kc, vc, torch.randn(1, 1, 64), torch.randn(1, 1, 64), torch.tensor([0]))


def test_the_pool_stores_quantized_rows_and_holds_more_tokens():
    bf16 = KVShape(num_layers=28, kv_heads=2, head_dim=128, block_size=16, dtype=torch.bfloat16)
    q8, q4 = (KVShape(28, 2, 128, 16, resolve_kv_cache_dtype(n, CPU, torch.float32)) for n in FORMATS)
    assert (q8.dtype, q4.dtype) == ("q8_0", "q4_0")
    assert bf16.bytes_per_block / q8.bytes_per_block == 256 / 136          # ~1.9x the tokens
    assert bf16.bytes_per_block / q4.bytes_per_block == 256 / 72           # ~3.6x
    pool = KVPool(KVShape(2, 2, 64, 16, "q4_0"), 3, CPU)
    assert all(t.dtype == torch.uint8 and t.shape == (3, 16, 2, 36) for layer in pool.layers for t in layer)
    assert pool.nbytes == 2 * 2 * 3 * 16 * 2 * 36
    with pytest.raises(KVCacheDtypeError, match="kv_cache_dtype q4_0 needs head_dim a multiple of 32; this model "
                                                "has 48"):
        KVShape(2, 2, 48, 16, "q4_0")
    with pytest.raises(KVCacheDtypeError, match="kv_cache_dtype q8_0 needs block_size a multiple of 16"):
        KVShape(2, 2, 64, 8, "q8_0")


def test_an_engine_refuses_a_quantized_cache_for_its_head_dim_before_loading_weights(tiny_checkpoint, monkeypatch):
    """The head_dim and block_size checks run on the model's config and the engine's, so a bad kv_cache_dtype
    fails before the weights load."""
    import engine.builder
    from engine import LLM

    def load_weights(*args, **kwargs):
        raise AssertionError("weights loaded before the K/V dtype was checked")

    monkeypatch.setattr(engine.builder, "build_decoder", load_weights)
    with pytest.raises(KVCacheDtypeError, match="kv_cache_dtype q8_0 needs head_dim a multiple of 32; this model "
                                                "has 48"):
        LLM(str(tiny_checkpoint(head_dim=48, heads=2, kv_heads=1)), kv_cache_dtype="q8_0")
    with pytest.raises(KVCacheDtypeError, match="kv_cache_dtype q4_0 needs block_size a multiple of 16 .*got 8"):
        LLM(str(tiny_checkpoint(head_dim=64, heads=2, kv_heads=1)), kv_cache_dtype="q4_0", block_size=8)


def test_rotary_mean_is_the_mean_of_the_vector_rotated_to_every_position():
    x = torch.randn(1, 3, 64, generator=_gen(7), dtype=torch.float64)
    table = rope_cos_sin(50, 48, 10000.0)                 # partial rotary: the last 16 channels stay
    _, rotated = reference_rotary(x.expand(50, 3, 64), x.expand(50, 3, 64), torch.arange(50), table, 48)
    got = rotary_mean(x[0], table, 48)
    torch.testing.assert_close(got, rotated.mean(0), atol=1e-12, rtol=0)
    assert torch.equal(got[:, 48:], x[0, :, 48:])


def _biased_keys(ctx: int, heads: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys after RoPE (theta 1e6, head_dim 128) at positions 0..ctx-1 whose pre-RoPE values carry a bias
    of a few hundred in most of the lowest-frequency pairs, as Qwen2.5's first layer has; the bias's mean
    rotation over the positions; values."""
    g = _gen(seed)
    table = rope_cos_sin(ctx, 128, 1e6)
    bias = torch.zeros(heads, 128)
    big = torch.randn(heads, 2, 12, generator=g).sign() * (100 + 250 * torch.rand(heads, 2, 12, generator=g))
    bias[:, 52:64], bias[:, 116:128] = big[:, 0], big[:, 1]
    pre = torch.randn(ctx, heads, 128, generator=g) * 2 + bias
    _, k = torch_rotary(pre, pre, torch.arange(ctx), table, 128)
    return k, rotary_mean(bias, table, 128).float(), torch.randn(ctx, heads, 128, generator=g)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: str | None) -> torch.Tensor:
    """pagedserve.paged_attention of a fresh prefill row and of a decode row after it, over k / v written
    into one row's cache of `fmt` (None: fp32), as float64 [ctx, Hq, D]."""
    ctx, heads, _ = k.shape
    blocks = -(-ctx // 16)
    if fmt:
        k_cache, v_cache = (torch.zeros(blocks, 16, heads, kv_quant.row_bytes(fmt, 128), dtype=torch.uint8)
                            for _ in range(2))
    else:
        k_cache, v_cache = (torch.zeros(blocks, 16, heads, 128) for _ in range(2))
    pagedserve.write_kv(k_cache, v_cache, k, v, torch.arange(ctx))
    out = pagedserve.paged_attention(q, k_cache, v_cache, torch.tensor([0, ctx - 1, ctx], dtype=torch.int32),
                                     torch.tensor([ctx - 1, ctx], dtype=torch.int32),
                                     torch.arange(blocks, dtype=torch.int32)[None].expand(2, -1).contiguous(),
                                     128 ** -0.5)
    return out.double()


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """_attend's rows (causal attention over positions 0..ctx-1) in float64 on the exact keys and values."""
    ctx, group = k.shape[0], q.shape[1] // k.shape[1]
    keys, values = (x.double().repeat_interleave(group, 1) for x in (k, v))
    scores = torch.einsum("thd,shd->hts", q.double(), keys) * 128 ** -0.5
    scores = scores.masked_fill(torch.ones(ctx, ctx, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), values)


# a little above the relative error measured on these keys less their offset
QUANT_ATTENTION_ERROR = {"q8_0": 0.015, "q4_0": 0.2}


@pytest.mark.usefixtures("cpp_kernels")
@pytest.mark.parametrize("fmt", FORMATS)
def test_keys_stored_less_a_constant_offset_attend_the_same_and_quantize_finely(fmt):
    """Every key less one constant vector moves each query's scores by one constant, which the softmax
    drops: an fp32 cache gives the same outputs (C++ decode row, SDPA prefill row). Stored as they are, the
    bias sets the scales of the blocks that hold it and the rest of those blocks is lost; less the bias's
    mean rotation, the error is a quantized cache's usual one."""
    ctx = 96
    k, offset, v = _biased_keys(ctx, 2, seed=3)
    q = torch.randn(ctx, 6, 128, generator=_gen(4))
    exact = _dense(q, k, v)
    torch.testing.assert_close(_attend(q, k - offset, v, None), exact, atol=1e-4, rtol=1e-4)

    def error(keys):
        return float((_attend(q, keys, v, fmt) - exact).norm() / exact.norm())
    as_they_are, less_offset = error(k), error(k - offset)
    assert less_offset < QUANT_ATTENTION_ERROR[fmt], less_offset
    assert as_they_are > 4 * less_offset, (as_they_are, less_offset)
