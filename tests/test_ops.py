"""pagedserve ops: schema/fake checks (opcheck), op == pure-torch reference, references == independent oracles
(transformers for norm/rotary, a dense causal attention for the paged attention), and torch.compile == eager."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3NextConfig
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb as hf_apply_rotary
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding
from transformers.models.qwen3_next.modeling_qwen3_next import apply_rotary_pos_emb as hf_apply_partial_rotary

import ops
from ops._registry import backend_for
from ops.paged_attention import reference_paged_attention
from ops.rms_norm import reference_add_rms_norm, reference_rms_norm, torch_add_rms_norm, torch_rms_norm
from ops.rotary import reference_rotary, rope_cos_sin
from ops.silu_and_mul import reference_silu_and_mul
from ops.write_kv import reference_write_kv

pagedserve = torch.ops.pagedserve
BLOCK = 16
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- paged batch builder (test-only)

def _paged_batch(rows: list[tuple[int, int]], q_heads: int, kv_heads: int, head_dim: int, dtype, seed: int = 0,
                 pad_tokens: int = 0):
    """rows = [(context_len, new_tokens)]. Returns q, caches (filled through reference_write_kv with shuffled
    block tables), qsl, context_lens, block_tables, slot_mapping of the new tokens, and the new k/v."""
    g = _gen(seed)
    max_blocks = max(-(-ctx // BLOCK) for ctx, _ in rows) + 1
    num_blocks = len(rows) * max_blocks + 3
    order = torch.randperm(num_blocks, generator=g)
    tables = order[: len(rows) * max_blocks].view(len(rows), max_blocks).int()
    for i, (ctx, _) in enumerate(rows):            # entries past a row's context are junk on purpose
        tables[i, -(-ctx // BLOCK):] = -1 if i % 2 else num_blocks + 7
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=g).to(dtype)
    slots = [int(tables[i, p // BLOCK]) * BLOCK + p % BLOCK for i, (ctx, _) in enumerate(rows) for p in range(ctx)]
    all_k = torch.randn(len(slots), kv_heads, head_dim, generator=g).to(dtype)
    all_v = torch.randn(len(slots), kv_heads, head_dim, generator=g).to(dtype)
    reference_write_kv(k_cache, v_cache, all_k, all_v, torch.tensor(slots))
    total = sum(n for _, n in rows)
    q = torch.randn(total + pad_tokens, q_heads, head_dim, generator=g).to(dtype)
    qsl = torch.tensor([0] + [sum(n for _, n in rows[: i + 1]) for i in range(len(rows))], dtype=torch.int32)
    ctx_lens = torch.tensor([ctx for ctx, _ in rows], dtype=torch.int32)
    return q, k_cache, v_cache, qsl, ctx_lens, tables


RAGGED = [(17, 1), (33, 5), (15, 1), (16, 16), (40, 0), (1, 1), (48, 17)]


# ---------------------------------------------------------------- opcheck

def _opcheck_samples():
    g = _gen(1)
    x = torch.randn(5, 64, generator=g)
    w = torch.rand(64, generator=g) + 0.5
    q, kc, vc, qsl, ctx, bt = _paged_batch(RAGGED, 4, 2, 32, torch.float32, pad_tokens=2)
    qr, kr = torch.randn(6, 4, 32, generator=g), torch.randn(6, 2, 32, generator=g)
    kv_new = torch.randn(4, 2, 32, generator=g)
    return [
        (pagedserve.rms_norm, (x, w, 1e-6)),
        (pagedserve.add_rms_norm, (x, torch.randn(5, 64, generator=g), w, 1e-6)),
        (pagedserve.rotary, (qr, kr, torch.tensor([0, 3, 9, 1, 2, 30]), rope_cos_sin(32, 16, 10000.0), 16)),
        (pagedserve.silu_and_mul, (torch.randn(5, 48, generator=g),)),
        (pagedserve.write_kv, (kc.clone(), vc.clone(), kv_new, kv_new * 2, torch.tensor([3, -1, 40, 17]))),
        (pagedserve.paged_attention, (q, kc, vc, qsl, ctx, bt, 0.25)),
    ]


@pytest.mark.parametrize("op, args", _opcheck_samples(), ids=lambda v: getattr(v, "__name__", ""))
def test_opcheck(op, args):
    torch.library.opcheck(op, args)


# ---------------------------------------------------------------- rms_norm

@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers(dtype, backend):
    """The torch body equals transformers bit for bit; the C++ kernel rounds at the same places and
    sums the squares in another order: the scale can differ in its last bit, which the two rounded
    products carry into a difference of up to ~2 ulps (bounded here by 4)."""
    import ops.cpu
    g = _gen(2)
    hf = Qwen3RMSNorm(96, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.rand(96, generator=g) + 0.5)
    x = (torch.randn(3, 7, 96, generator=g) * 3).to(dtype)
    residual = torch.randn(3, 7, 96, generator=g).to(dtype)
    with torch.no_grad():
        expected = hf(x)
        expected_added = hf(residual + x)
    if backend == "cpp":
        assert ops.cpu.kernels_available(), "the C++ kernels did not build on this machine"
    rms_norm, add_rms_norm = ((ops.cpu.cpp_rms_norm, ops.cpu.cpp_add_rms_norm) if backend == "cpp"
                              else (torch_rms_norm, torch_add_rms_norm))
    normed, summed = add_rms_norm(x, residual, hf.weight.detach(), 1e-6)
    assert torch.equal(summed, residual + x)
    for got, want in ((rms_norm(x, hf.weight.detach(), 1e-6), expected), (normed, expected_added)):
        if backend == "torch":
            assert torch.equal(got, want)
        else:
            ulps = 4 * torch.finfo(dtype).eps * want.abs().clamp_min(torch.finfo(dtype).tiny)
            assert ((got - want).abs() <= ulps).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_reference(dtype):
    g = _gen(3)
    x, r, w = (torch.randn(9, 40, generator=g).to(dtype), torch.randn(9, 40, generator=g).to(dtype),
               torch.randn(40, generator=g).to(dtype))
    torch.testing.assert_close(pagedserve.rms_norm(x, w, 1e-5), reference_rms_norm(x, w, 1e-5), **TOL[dtype])
    for got, want in zip(pagedserve.add_rms_norm(x, r, w, 1e-5), reference_add_rms_norm(x, r, w, 1e-5)):
        torch.testing.assert_close(got, want, **TOL[dtype])


# ---------------------------------------------------------------- rotary

def test_rope_table_matches_transformers():
    config = Qwen3Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=64, rope_theta=1e6)
    cos, sin = Qwen3RotaryEmbedding(config)(torch.zeros(1), torch.arange(50)[None])
    table = rope_cos_sin(50, 64, 1e6)
    assert torch.equal(table[:, :32], cos[0, :, :32]) and torch.equal(table[:, 32:], sin[0, :, :32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_rotary_matches_transformers_bit_for_bit(dtype):
    g = _gen(4)
    config = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_theta=1e6)
    q, k = torch.randn(9, 4, 64, generator=g).to(dtype), torch.randn(9, 2, 64, generator=g).to(dtype)
    positions = torch.tensor([0, 1, 2, 17, 18, 100, 5, 6, 250])
    cos, sin = Qwen3RotaryEmbedding(config)(q, positions[None])
    want_q, want_k = hf_apply_rotary(q[None].transpose(1, 2), k[None].transpose(1, 2), cos, sin)
    got_q, got_k = pagedserve.rotary(q, k, positions, rope_cos_sin(256, 64, 1e6), 64)
    assert torch.equal(got_q, want_q.transpose(1, 2)[0]) and torch.equal(got_k, want_k.transpose(1, 2)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_matches_transformers_bit_for_bit(dtype):
    g = _gen(5)
    config = Qwen3NextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                             partial_rotary_factor=0.25, rope_theta=10000.0)
    q, k = torch.randn(6, 4, 64, generator=g).to(dtype), torch.randn(6, 2, 64, generator=g).to(dtype)
    positions = torch.tensor([3, 4, 5, 0, 31, 7])
    cos, sin = Qwen3NextRotaryEmbedding(config)(q, positions[None])
    want_q, want_k = hf_apply_partial_rotary(q[None].transpose(1, 2), k[None].transpose(1, 2), cos, sin)
    got_q, got_k = pagedserve.rotary(q, k, positions, rope_cos_sin(32, 16, 10000.0), 16)
    assert torch.equal(got_q, want_q.transpose(1, 2)[0]) and torch.equal(got_k, want_k.transpose(1, 2)[0])
    assert torch.equal(got_q[..., 16:], q[..., 16:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, rotary_dim", [(32, 32), (64, 32), (128, 64), (128, 128)])
def test_rotary_matches_reference(dtype, head_dim, rotary_dim):
    g = _gen(6)
    q, k = torch.randn(7, 4, head_dim, generator=g).to(dtype), torch.randn(7, 1, head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 64, (7,), generator=g)
    table = rope_cos_sin(64, rotary_dim, 5e5)
    got = pagedserve.rotary(q, k, positions, table, rotary_dim)
    for a, b in zip(got, reference_rotary(q, k, positions, table, rotary_dim)):
        torch.testing.assert_close(a, b, **TOL[dtype])


# ---------------------------------------------------------------- silu_and_mul

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    x = torch.randn(6, 2 * 24, generator=_gen(7)).to(dtype)
    got = pagedserve.silu_and_mul(x)
    # gate first, then up, like HF's MLP (the C++ kernel's exp differs from torch's in fp32's last bits)
    torch.testing.assert_close(got, F.silu(x[:, :24]) * x[:, 24:], rtol=1e-6 if dtype == torch.float32 else 2 ** -7,
                               atol=0)
    torch.testing.assert_close(got, reference_silu_and_mul(x), **TOL[dtype])


# ---------------------------------------------------------------- write_kv

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_reference_and_skips_padding(dtype):
    g = _gen(8)
    k_cache = torch.randn(5, BLOCK, 2, 32, generator=g).to(dtype)
    v_cache = torch.randn(5, BLOCK, 2, 32, generator=g).to(dtype)
    k, v = torch.randn(6, 2, 32, generator=g).to(dtype), torch.randn(6, 2, 32, generator=g).to(dtype)
    slots = torch.tensor([79, -1, 0, 33, -1, 16])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference_write_kv(want_k, want_v, k, v, slots)
    before = k_cache.clone()
    pagedserve.write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert torch.equal(k_cache[4, 15], k[0]) and torch.equal(k_cache[2, 1], k[3])   # 79 = 4*16+15, 33 = 2*16+1
    changed = (k_cache != before).any(-1).any(-1).nonzero().tolist()
    assert changed == [[0, 0], [1, 0], [2, 1], [4, 15]]                              # padding wrote nothing


def test_write_kv_rejects_slot_past_cache():
    cache = torch.zeros(2, BLOCK, 1, 8)
    with pytest.raises(ops.OpInputError, match="past the cache's last slot 31"):
        pagedserve.write_kv(cache, cache.clone(), torch.ones(1, 1, 8), torch.ones(1, 1, 8), torch.tensor([32]))


# ---------------------------------------------------------------- paged_attention

def _dense_causal(q, k, v, scale):
    """Hand-written attention over one contiguous sequence: q [T, Hq, D], k/v [T, Hk, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    future = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_reference_matches_dense_attention_on_contiguous_sequence(group):
    g = _gen(9)
    length, kv_heads, head_dim = 33, 2, 32
    q = torch.randn(length, kv_heads * group, head_dim, generator=g)
    k, v = torch.randn(length, kv_heads, head_dim, generator=g), torch.randn(length, kv_heads, head_dim, generator=g)
    table = torch.tensor([[4, 0, 2]], dtype=torch.int32)
    k_cache, v_cache = torch.zeros(5, BLOCK, kv_heads, head_dim), torch.zeros(5, BLOCK, kv_heads, head_dim)
    slots = torch.tensor([int(table[0, p // BLOCK]) * BLOCK + p % BLOCK for p in range(length)])
    reference_write_kv(k_cache, v_cache, k, v, slots)
    qsl, ctx = torch.tensor([0, length], dtype=torch.int32), torch.tensor([length], dtype=torch.int32)
    want = _dense_causal(q, k, v, 0.3)
    torch.testing.assert_close(reference_paged_attention(q, k_cache, v_cache, qsl, ctx, table, 0.3), want,
                               atol=1e-5, rtol=1e-5)
    # The op, fed in three chunks (prefill 15, prefill 17, decode 1) over the same cache, gives the same rows.
    for start, end in [(0, 15), (15, 32), (32, 33)]:
        qsl = torch.tensor([0, end - start], dtype=torch.int32)
        chunk = pagedserve.paged_attention(q[start:end], k_cache, v_cache, qsl, torch.tensor([end], dtype=torch.int32),
                                           table, 0.3)
        torch.testing.assert_close(chunk, want[start:end], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_paged_attention_matches_reference_on_ragged_batch(dtype, group, head_dim):
    kv_heads = 2
    q, kc, vc, qsl, ctx, bt = _paged_batch(RAGGED, kv_heads * group, kv_heads, head_dim, dtype,
                                           seed=group * head_dim, pad_tokens=3)
    scale = head_dim ** -0.5
    got = pagedserve.paged_attention(q, kc, vc, qsl, ctx, bt, scale)
    want = reference_paged_attention(q, kc, vc, qsl, ctx, bt, scale)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert not got[int(qsl[-1]):].any()                       # padding tokens come back as zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chunk_after_a_long_prefix_attends_it_in_two_merged_parts(dtype, monkeypatch):
    """From SPLIT_PREFIX cached tokens on, a prefill row attends the prefix unmasked and itself causally in two
    flash calls merged by their log-sum-exps: the same attention as the one masked call."""
    import ops.paged_attention as attention
    monkeypatch.setattr(attention, "SPLIT_PREFIX", 40)
    split = []
    real = attention._split_at_prefix
    monkeypatch.setattr(attention, "_split_at_prefix", lambda *a: split.append(a[3]) or real(*a))
    rows = [(100, 37), (45, 5), (30, 30), (39, 9)]         # (context, new tokens): prefixes 63, 40, 0, 30
    q, kc, vc, qsl, ctx, bt = _paged_batch(rows, 6, 2, 64, dtype, seed=9)
    got = attention.torch_paged_attention(q, kc, vc, qsl, ctx, bt, 0.125)
    torch.testing.assert_close(got, reference_paged_attention(q, kc, vc, qsl, ctx, bt, 0.125), **TOL[dtype])
    assert split == [63, 40]


@pytest.mark.parametrize("context", [15, 16, 17, 33])
def test_paged_attention_decode_only_across_block_boundaries(context):
    rows = [(context, 1), (context + 1, 1), (max(context - 14, 1), 1)]
    q, kc, vc, qsl, ctx, bt = _paged_batch(rows, 4, 1, 64, torch.float32, seed=context)
    got = pagedserve.paged_attention(q, kc, vc, qsl, ctx, bt, 0.125)
    torch.testing.assert_close(got, reference_paged_attention(q, kc, vc, qsl, ctx, bt, 0.125), **TOL[torch.float32])


def test_paged_attention_rejects_bad_inputs():
    q, kc, vc, qsl, ctx, bt = _paged_batch([(17, 2)], 3, 2, 32, torch.float32)
    with pytest.raises(ops.OpInputError, match="multiple of cache heads 2"):
        pagedserve.paged_attention(q, kc, vc, qsl, ctx, bt, 0.1)
    q, kc, vc, qsl, ctx, bt = _paged_batch([(17, 2)], 4, 2, 32, torch.float32)
    with pytest.raises(ops.OpInputError, match="context_lens must be int32"):
        pagedserve.paged_attention(q, kc, vc, qsl, ctx.long(), bt, 0.1)
    with pytest.raises(ops.OpInputError, match=r"new tokens \(2\) <= context_lens \(1\)"):
        pagedserve.paged_attention(q, kc, vc, qsl, torch.tensor([1], dtype=torch.int32), bt, 0.1)


def test_dispatch_picks_the_backend_registered_for_the_device(monkeypatch):
    from ops import _registry
    assert backend_for(torch.device("cpu"), "rms_norm") == "cpu"
    assert backend_for(torch.device("cuda"), "rms_norm") == "cuda"
    with pytest.raises(ops.OpInputError, match="device 'mps'"):
        backend_for(torch.device("mps"), "rms_norm")
    calls = []
    monkeypatch.setitem(_registry._IMPLS, ("silu_and_mul", "cpu"),
                        lambda x: calls.append(x) or x[..., : x.shape[-1] // 2].clone())
    pagedserve.silu_and_mul(torch.ones(2, 4))
    assert len(calls) == 1
    monkeypatch.delitem(_registry._IMPLS, ("silu_and_mul", "cpu"))
    with pytest.raises(NotImplementedError, match="silu_and_mul has no cpu kernel"):
        pagedserve.silu_and_mul(torch.ones(2, 4))


# ---------------------------------------------------------------- torch.compile

def _attention_layer(x, norm_weight, k_cache, v_cache, positions, slots, qsl, ctx, tables, table):
    """A miniature attention block written the way the model code calls the ops."""
    h = torch.ops.pagedserve.rms_norm(x, norm_weight, 1e-6)
    q, k, v = h.view(x.shape[0], 6, 32).split([4, 1, 1], dim=1)
    q, k = torch.ops.pagedserve.rotary(q, k, positions, table, 16)
    torch.ops.pagedserve.write_kv(k_cache, v_cache, k, v, slots)
    out = torch.ops.pagedserve.paged_attention(q, k_cache, v_cache, qsl, ctx, tables, 32 ** -0.5)
    return torch.ops.pagedserve.silu_and_mul(out.reshape(x.shape[0], -1))


def _compile_inputs():
    g = _gen(11)
    rows = [(20, 1), (18, 18), (9, 4)]                         # decode, fresh prefill, chunk with prefix
    _, kc, vc, qsl, ctx, tables = _paged_batch(rows, 4, 1, 32, torch.float32, seed=11)
    positions = torch.cat([torch.arange(c - n, c) for c, n in rows] + [torch.zeros(2, dtype=torch.long)])
    slots = torch.tensor([int(tables[i, p // BLOCK]) * BLOCK + p % BLOCK
                          for i, (c, n) in enumerate(rows) for p in range(c - n, c)] + [-1, -1])
    x = torch.randn(len(positions), 6 * 32, generator=g)
    return [x, torch.rand(6 * 32, generator=g) + 0.5, kc, vc, positions, slots, qsl, ctx, tables,
            rope_cos_sin(64, 16, 10000.0)]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_layer_matches_eager(backend):
    eager_args, compiled_args = _compile_inputs(), _compile_inputs()
    want = _attention_layer(*eager_args)
    got = torch.compile(_attention_layer, backend=backend, fullgraph=True)(*compiled_args)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled_args[2], eager_args[2])   # the cache mutation survived compilation
    torch.testing.assert_close(compiled_args[3], eager_args[3])
