"""Every Triton kernel in ops/triton against its op's pure-torch reference, run on CPU by the Triton interpreter.

The launchers are called directly (under the interpreter tensors are CPU tensors, so the op's device dispatch
would pick the CPU backend). `make gpu-check` reruns this file on a GPU with PAGEDSERVE_TEST_DEVICE=cuda:
inputs are built on CPU, the kernels run on the GPU, results come back for the same comparisons.
The interpreter is slow (~1 s per small launch), so shapes are tiny but cover GQA, non-power-of-two head
sizes, page boundaries, ragged and empty rows, padding tokens and split-K.
Its float32 -> bfloat16 casts truncate instead of rounding to nearest, so bf16 results may differ from the
references by one bf16 ulp; fp32 results must match to float rounding.
"""
from __future__ import annotations

import os

DEVICE = os.environ.get("PAGEDSERVE_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"   # must precede the first import of the kernels (decided at @triton.jit)

import pytest  # noqa: E402
import torch  # noqa: E402
from test_ops import _paged_batch  # noqa: E402  (test-only paged batch builder: shuffled tables, junk entries)

from ops import kv_quant  # noqa: E402
from ops.causal_conv1d import reference_causal_conv1d  # noqa: E402
from ops.gated_delta_rule import reference_gated_delta_rule  # noqa: E402
from ops.paged_attention import reference_paged_attention  # noqa: E402
from ops.rms_norm import reference_add_rms_norm, reference_rms_norm  # noqa: E402
from ops.rotary import reference_rotary, rope_cos_sin  # noqa: E402
from ops.silu_and_mul import reference_silu_and_mul  # noqa: E402
from ops.triton import KERNELS  # noqa: E402
from ops.triton._launch import interpreting  # noqa: E402
from ops.triton.gated_delta_rule import CHUNK as TRITON_DELTA_CHUNK  # noqa: E402
from ops.write_kv import reference_write_kv, torch_write_kv  # noqa: E402

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[dtype])


def _run(name: str, *args, **kwargs):
    """KERNELS[name] on DEVICE; tensor results come back to CPU and mutated inputs are copied back in place."""
    moved = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    result = KERNELS[name](*moved, **kwargs)
    for a, m in zip(args, moved):
        if isinstance(a, torch.Tensor) and m is not a:
            a.copy_(m.cpu())
    if isinstance(result, tuple):
        return tuple(r.cpu() for r in result)
    return None if result is None else result.cpu()


def test_kernels_run_where_intended():
    if DEVICE == "cpu":
        assert interpreting(), "ops.triton was imported before TRITON_INTERPRET=1 was set: these tests need it first"
    else:
        assert not interpreting() and torch.device(DEVICE).type == "cuda" and torch.cuda.is_available()


# ---------------------------------------------------------------- paged attention

# (context_len, new tokens): decode rows, a prefill chunk after a cached prefix, a whole prompt, an empty row,
# a padding row (0, 0), contexts ending exactly on and just past the 16-token page boundaries
ROWS = [(17, 1), (6, 3), (0, 0), (20, 0), (16, 16), (1, 1), (33, 1)]


@pytest.mark.parametrize("q_heads, kv_heads, head_dim, block_q, num_splits", [
    (4, 2, 16, None, None),     # GQA 2, prefill-sized tiles
    (6, 2, 24, 8, 2),           # GQA 3 (padded to 4), head_dim 24 (padded to 32), split-K (empty splits too)
    (2, 2, 16, 2, 1),           # MHA, rows spread over many small tiles
])
def test_paged_attention_matches_reference(q_heads, kv_heads, head_dim, block_q, num_splits):
    q, k_cache, v_cache, qsl, ctx, tables = _paged_batch(ROWS, q_heads, kv_heads, head_dim, torch.float32,
                                                         pad_tokens=2)
    out = _run("paged_attention", q, k_cache, v_cache, qsl, ctx, tables, 0.3, block_q=block_q,
                                     num_splits=num_splits)
    _close(out, reference_paged_attention(q, k_cache, v_cache, qsl, ctx, tables, 0.3), torch.float32)
    assert not out[int(qsl[-1]):].any(), "padding tokens past query_start_loc[-1] must stay zero"


def test_paged_attention_bf16_decode_batch_with_default_split():
    rows = [(40, 1), (3, 1), (16, 1), (0, 0)]
    q, k_cache, v_cache, qsl, ctx, tables = _paged_batch(rows, 4, 2, 16, torch.bfloat16)
    out = _run("paged_attention", q, k_cache, v_cache, qsl, ctx, tables, 0.25)
    _close(out, reference_paged_attention(q, k_cache, v_cache, qsl, ctx, tables, 0.25), torch.bfloat16)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_paged_attention_reads_a_16_bit_cache_with_fp32_queries(kv_dtype):
    """kv_cache_dtype narrower than the activations: decode rows (split-K) and a prefill chunk after a cached
    prefix, against the reference on the cache as stored."""
    q, k_cache, v_cache, qsl, ctx, tables = _paged_batch(ROWS, 4, 2, 16, torch.float32, pad_tokens=1)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    out = _run("paged_attention", q, k_cache, v_cache, qsl, ctx, tables, 0.3, num_splits=2)
    assert out.dtype == torch.float32
    _close(out, reference_paged_attention(q, k_cache, v_cache, qsl, ctx, tables, 0.3), torch.float32)


@pytest.mark.parametrize("fmt", kv_quant.FORMATS)
def test_paged_attention_dequantizes_a_quantized_cache(fmt):
    """q8_0 / q4_0 rows (K rotated, so the launcher rotates q): decode rows (split-K) and a prefill chunk
    after a cached prefix, against the reference on the dequantized cache."""
    q, k_cache, v_cache, qsl, ctx, tables = _paged_batch(ROWS, 6, 2, 64, torch.float32, pad_tokens=1)
    kc, vc = (torch.zeros(*k_cache.shape[:3], kv_quant.row_bytes(fmt, 64), dtype=torch.uint8) for _ in range(2))
    reference_write_kv(kc, vc, k_cache.flatten(0, 1), v_cache.flatten(0, 1), torch.arange(kc.shape[0] * 16))
    out = _run("paged_attention", q, kc, vc, qsl, ctx, tables, 0.3, num_splits=2)
    _close(out, reference_paged_attention(q, kc, vc, qsl, ctx, tables, 0.3), torch.float32)


# ---------------------------------------------------------------- write_kv, norms, rotary, activation

@pytest.mark.parametrize("fmt", kv_quant.FORMATS)
@pytest.mark.parametrize("heads, head_dim", [(2, 64), (3, 96)])      # padded heads and blocks
def test_write_kv_quantizes_to_the_torch_bodys_bytes(fmt, heads, head_dim):
    g = _gen(6)
    kc, vc = (torch.zeros(3, 16, heads, kv_quant.row_bytes(fmt, head_dim), dtype=torch.uint8) for _ in range(2))
    k, v = torch.randn(5, heads, head_dim, generator=g) * 3, torch.randn(5, heads, head_dim, generator=g)
    k[1], k[2, 0, :32], k[2, 0, 0] = 0.0, 0.0, -0.0      # zero blocks, one starting with -0.0
    slots = torch.tensor([0, 17, -1, 47, 5])
    expected_k, expected_v = kc.clone(), vc.clone()
    torch_write_kv(expected_k, expected_v, k, v, slots)
    _run("write_kv", kc, vc, k, v, slots)
    assert torch.equal(kc, expected_k) and torch.equal(vc, expected_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_reference_and_skips_padding(dtype):
    g = _gen(1)
    k_cache = torch.randn(4, 16, 2, 24, generator=g).to(dtype)
    v_cache = torch.randn(4, 16, 2, 24, generator=g).to(dtype)
    k, v = torch.randn(5, 2, 24, generator=g).to(dtype), torch.randn(5, 2, 24, generator=g).to(dtype)
    slots = torch.tensor([15, -1, 16, 63, 0])            # both sides of a page boundary, the last slot
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference_write_kv(expected_k, expected_v, k, v, slots)
    _run("write_kv", k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_write_kv_converts_to_the_cache_dtype(kv_dtype):
    g = _gen(4)
    k_cache, v_cache = torch.zeros(3, 16, 2, 24, dtype=kv_dtype), torch.zeros(3, 16, 2, 24, dtype=kv_dtype)
    k, v = torch.randn(4, 2, 24, generator=g), torch.randn(4, 2, 24, generator=g)
    slots = torch.tensor([0, 17, -1, 47])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference_write_kv(expected_k, expected_v, k, v, slots)
    _run("write_kv", k_cache, v_cache, k, v, slots)
    # the interpreter's fp32 -> bf16 cast truncates: within one bf16 ulp of the rounded reference
    ulp = dict(atol=0, rtol=2 ** -7) if kv_dtype == torch.bfloat16 else dict(atol=0, rtol=0)
    torch.testing.assert_close(k_cache, expected_k, **ulp)
    torch.testing.assert_close(v_cache, expected_v, **ulp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_add_rms_norm_match_reference(dtype):
    g = _gen(2)
    x, residual = torch.randn(3, 2, 40, generator=g).to(dtype), torch.randn(3, 2, 40, generator=g).to(dtype)
    weight = (torch.rand(40, generator=g) + 0.5).to(dtype)
    _close(_run("rms_norm", x, weight, 1e-6), reference_rms_norm(x, weight, 1e-6), dtype)
    out, summed = _run("add_rms_norm", x, residual, weight, 1e-6)
    expected_out, expected_sum = reference_add_rms_norm(x, residual, weight, 1e-6)
    _close(out, expected_out, dtype)
    _close(summed, expected_sum, dtype)


def test_rms_norm_fp32_weight_on_bf16_input_promotes_like_the_op():
    g = _gen(3)
    x, weight = torch.randn(4, 32, generator=g).bfloat16(), torch.rand(32, generator=g) + 0.5
    out = _run("rms_norm", x, weight, 1e-5)
    _close(out, reference_rms_norm(x, weight, 1e-5), torch.bfloat16)
    assert out.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, rotary_dim", [(16, 16), (24, 12)])   # full, and partial with padded halves
def test_rotary_matches_reference(dtype, head_dim, rotary_dim):
    g = _gen(4)
    q, k = torch.randn(5, 4, head_dim, generator=g).to(dtype), torch.randn(5, 2, head_dim, generator=g).to(dtype)
    positions = torch.tensor([0, 3, 31, 1, 17])
    table = rope_cos_sin(32, rotary_dim, 10000.0)
    q_out, k_out = _run("rotary", q, k, positions, table, rotary_dim)
    q_ref, k_ref = reference_rotary(q, k, positions, table, rotary_dim)
    _close(q_out, q_ref, dtype)
    _close(k_out, k_ref, dtype)
    assert torch.equal(q_out[..., rotary_dim:], q[..., rotary_dim:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_reference(dtype):
    x = torch.randn(2, 3, 2 * 40, generator=_gen(5)).to(dtype)
    _close(_run("silu_and_mul", x), reference_silu_and_mul(x), dtype)


# ---------------------------------------------------------------- hybrid-model ops (state slots)

LENGTHS = [3, 1, 0, 5, 1, 2]                             # prefill chunks, decode rows, an empty row
SLOTS = [2, 0, 4, -1, 3, 1]                              # slot -1: a row without state (padding)


def _qsl(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _delta_inputs(num_tokens: int, dtype: torch.dtype, seed: int = 6, dk: int = 12, dv: int = 10):
    """Hk=2 q/k heads, Hv=4 value heads (GQA 2); q, k of about unit norm, so that the recurrence stays
    bounded over long rows without L2 normalisation too."""
    g = _gen(seed)
    q, k = ((torch.randn(num_tokens, 2, dk, generator=g) * dk ** -0.5).to(dtype) for _ in range(2))
    v = torch.randn(num_tokens, 4, dv, generator=g).to(dtype)
    decay = (-torch.rand(num_tokens, 4, generator=g)).to(dtype)
    beta = torch.rand(num_tokens, 4, generator=g).to(dtype)
    return q, k, v, decay, beta


@pytest.mark.parametrize("dtype, l2norm", [(torch.float32, True), (torch.float32, False), (torch.bfloat16, True)])
def test_gated_delta_rule_matches_reference_and_updates_slots(dtype, l2norm):
    inputs = _delta_inputs(sum(LENGTHS) + 2, dtype)
    pool = torch.randn(5, 4, 12, 10, generator=_gen(7))
    qsl, slots = _qsl(LENGTHS), torch.tensor(SLOTS, dtype=torch.int32)
    expected_pool = pool.clone()
    expected = reference_gated_delta_rule(*inputs, expected_pool, qsl, slots, l2norm)
    out = _run("gated_delta_rule", *inputs, pool, qsl, slots, l2norm)
    _close(out, expected, dtype)
    torch.testing.assert_close(pool, expected_pool, atol=1e-5, rtol=1e-5)
    assert not out[int(qsl[-1]):].any() and not out[4:9].any(), "padding tokens and slot -1 rows stay zero"


@pytest.mark.parametrize("dtype, l2norm, chunk, dk, dv", [
    (torch.float32, True, 16, 24, 40),      # Dk padded to 32, Dv over two value blocks (the second one ragged)
    (torch.float32, False, 16, 24, 40),
    (torch.bfloat16, True, 16, 24, 40),
    (torch.float32, True, None, 12, 10),    # the launcher's default chunk
])
def test_gated_delta_rule_chunked_rows_match_reference(dtype, l2norm, chunk, dk, dv):
    size = chunk or TRITON_DELTA_CHUNK
    # rows shorter than, equal to and past one and two chunks (last chunk masked), the shortest chunked row
    # (2), decode rows, an empty row and a slot -1 row among them; 3 padding tokens at the end
    lengths = [2, 1, size - 1, 0, size, 1, size + 1, 3, 2 * size + 3]
    slots = torch.tensor([5, 0, 2, 6, 7, 3, 1, -1, 4], dtype=torch.int32)       # slot 8: no row
    qsl = _qsl(lengths)
    inputs = _delta_inputs(int(qsl[-1]) + 3, dtype, seed=10, dk=dk, dv=dv)
    pool = torch.randn(9, 4, dk, dv, generator=_gen(11))
    expected_pool = pool.clone()
    expected = reference_gated_delta_rule(*inputs, expected_pool, qsl, slots, l2norm)
    out = _run("gated_delta_rule", *inputs, pool, qsl, slots, l2norm, **({"chunk": chunk} if chunk else {}))
    _close(out, expected, dtype)
    torch.testing.assert_close(pool, expected_pool, atol=1e-5, rtol=1e-5)
    skipped = int(qsl[7]), int(qsl[8])
    assert not out[int(qsl[-1]):].any() and not out[skipped[0]:skipped[1]].any(), \
        "padding tokens and slot -1 rows stay zero"


def test_gated_delta_rule_prompt_split_over_calls_continues_exactly():
    # pieces (chunk 16): a partial chunk, one token (the decode path), a chunk and one, exactly one chunk
    inputs = _delta_inputs(39, torch.float32, seed=8)
    whole_pool = torch.randn(1, 4, 12, 10, generator=_gen(9))
    pool = whole_pool.clone()
    slot = torch.tensor([0], dtype=torch.int32)
    whole = reference_gated_delta_rule(*inputs, whole_pool, _qsl([39]), slot, True)
    parts = [_run("gated_delta_rule", *(x[a:b] for x in inputs), pool, _qsl([b - a]), slot, True, chunk=16)
             for a, b in [(0, 5), (5, 6), (6, 23), (23, 39)]]
    _close(torch.cat(parts), whole, torch.float32)
    torch.testing.assert_close(pool, whole_pool, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype, apply_silu, block_t", [
    (torch.float32, True, None), (torch.float32, False, 4), (torch.float32, True, 1), (torch.bfloat16, True, None),
])
def test_causal_conv1d_matches_reference_and_updates_slots(dtype, apply_silu, block_t):
    g = _gen(9)
    x = torch.randn(sum(LENGTHS) + 2, 20, generator=g).to(dtype)
    weight = torch.randn(20, 4, generator=g).to(dtype)
    state = torch.randn(5, 20, 3, generator=g).to(dtype)
    qsl, slots = _qsl(LENGTHS), torch.tensor(SLOTS, dtype=torch.int32)
    expected_state = state.clone()
    expected = reference_causal_conv1d(x, weight, expected_state, qsl, slots, apply_silu)
    out = _run("causal_conv1d", x, weight, state, qsl, slots, apply_silu, block_t=block_t)
    _close(out, expected, dtype)
    assert torch.equal(state, expected_state)          # the state is a copy of inputs: exact


# rows recording per-token checkpoints (speculative rollback): a 3-token row, a decode row, an empty row,
# a slotless row (records nothing), a 6-token row over two conv tiles of 4; rows 1's -1 records nothing
CK_LENGTHS, CK_START, CK_SIZE = [3, 1, 0, 5, 1, 6], [0, -1, 3, 4, 9, 10], 17


def _recorded(name: str, reference, args: tuple, state: torch.Tensor, flags: tuple, **kwargs):
    """The kernel and the reference on the same rows with checkpoints: (outputs, states, checkpoints) each."""
    qsl, slots = _qsl(CK_LENGTHS), torch.tensor(SLOTS, dtype=torch.int32)
    first = torch.tensor(CK_START, dtype=torch.int32)
    checkpoints = torch.full((CK_SIZE, *state.shape[1:]), 7.0, dtype=state.dtype)
    want_state, want_checkpoints = state.clone(), checkpoints.clone()
    want = reference(*args, want_state, qsl, slots, *flags, want_checkpoints, first)
    got = _run(name, *args, state, qsl, slots, *flags, checkpoints, first, **kwargs)
    return (got, want), (state, want_state), (checkpoints, want_checkpoints)


@pytest.mark.parametrize("dtype, l2norm", [(torch.float32, True), (torch.bfloat16, False)])
def test_gated_delta_rule_records_checkpoints_like_the_reference(dtype, l2norm):
    inputs = _delta_inputs(sum(CK_LENGTHS) + 2, dtype, seed=12)
    pool = torch.randn(5, 4, 12, 10, generator=_gen(13))
    out, states, checkpoints = _recorded("gated_delta_rule", reference_gated_delta_rule, inputs, pool, (l2norm,),
                                         chunk=16)
    _close(*out, dtype)
    for got, want in (states, checkpoints):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (checkpoints[0][16] == 7).all()


@pytest.mark.parametrize("block_t", [None, 4])
def test_causal_conv1d_records_checkpoints_like_the_reference(block_t):
    g = _gen(14)
    x = torch.randn(sum(CK_LENGTHS) + 2, 20, generator=g)
    weight = torch.randn(20, 4, generator=g)
    state = torch.randn(5, 20, 3, generator=g)
    out, states, checkpoints = _recorded("causal_conv1d", reference_causal_conv1d, (x, weight), state, (True,),
                                         block_t=block_t)
    _close(*out, torch.float32)
    assert torch.equal(*states) and torch.equal(*checkpoints)      # copies of inputs: exact
