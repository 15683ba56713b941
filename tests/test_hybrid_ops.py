"""Hybrid-model ops: opcheck, op == per-token reference (chunked and recurrent forms, state slots, padding),
prompt chunks continue exactly, per-token state checkpoints (speculative rollback), and agreement with
transformers' torch fallbacks (the oracle)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next.modeling_qwen3_next import (
    causal_conv1d_fn, torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule)

import ops  # noqa: F401
from ops._registry import OpInputError
from ops.causal_conv1d import reference_causal_conv1d
from ops.gated_delta_rule import reference_gated_delta_rule
from ops.moe import reference_moe_experts, reference_moe_route

pagedserve = torch.ops.pagedserve
HK, HV, DK, DV = 2, 4, 8, 6


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _delta_inputs(lengths: list[int], pad: int = 0, seed: int = 0, dtype=torch.float32):
    g = _gen(seed)
    t = sum(lengths) + pad
    q = torch.randn(t, HK, DK, generator=g).to(dtype)
    k = torch.randn(t, HK, DK, generator=g).to(dtype)
    v = torch.randn(t, HV, DV, generator=g).to(dtype)
    decay = -F.softplus(torch.randn(t, HV, generator=g))            # log decay <= 0, as the models make it
    beta = torch.sigmoid(torch.randn(t, HV, generator=g)).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, decay, beta, qsl


def _states(slots: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(slots, HV, DK, DV, generator=_gen(seed)) * 0.3


# lengths mix decode rows (1), short prefills and a prompt over two chunks of 64; row 3 has no slot
LENGTHS, SLOTS = [1, 5, 70, 3, 1, 17], [4, 0, 2, -1, 1, 5]


def test_gated_delta_rule_matches_per_token_reference_and_skips_padding():
    q, k, v, g, beta, qsl = _delta_inputs(LENGTHS, pad=3)
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    ours_state, ref_state = _states(7), _states(7)
    ours = pagedserve.gated_delta_rule(q, k, v, g, beta, ours_state, qsl, slots, True)
    ref = reference_gated_delta_rule(q, k, v, g, beta, ref_state, qsl, slots, True)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(ours_state, ref_state, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(ours_state[[3, 6]], _states(7)[[3, 6]], atol=0, rtol=0)  # unused slots untouched
    a, b = int(qsl[3]), int(qsl[4])
    assert ours[a:b].abs().max() == 0 and ours[-3:].abs().max() == 0   # slotless row and padding give zeros


@pytest.mark.parametrize("cuts", [[7, 8, 70], [1, 2, 3, 64, 66], [69]])
def test_gated_delta_rule_prompt_split_over_steps_continues_exactly(cuts):
    q, k, v, g, beta, _ = _delta_inputs([70], seed=3)
    whole_state = _states(1)
    whole = pagedserve.gated_delta_rule(q, k, v, g, beta, whole_state, torch.tensor([0, 70], dtype=torch.int32),
                                        torch.tensor([0], dtype=torch.int32), True)
    state, pieces, start = _states(1), [], 0
    for end in cuts + [70]:
        if end == start:
            continue
        sl = slice(start, end)
        pieces.append(pagedserve.gated_delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], state,
                                                  torch.tensor([0, end - start], dtype=torch.int32),
                                                  torch.tensor([0], dtype=torch.int32), True))
        start = end
    torch.testing.assert_close(torch.cat(pieces), whole, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(state, whole_state, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("n", [1, 9, 130])
def test_gated_delta_rule_matches_transformers_fallbacks(n):
    q, k, v, g, beta, qsl = _delta_inputs([n], seed=5)
    initial = _states(1)
    oracle = torch_recurrent_gated_delta_rule if n == 1 else torch_chunk_gated_delta_rule
    theirs, their_state = oracle(q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=initial.clone(),
                                 output_final_state=True, use_qk_l2norm_in_kernel=True)
    state = initial.clone()
    ours = pagedserve.gated_delta_rule(q, k, v, g, beta, state, qsl, torch.tensor([0], dtype=torch.int32), True)
    torch.testing.assert_close(ours, theirs[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, their_state, atol=1e-4, rtol=1e-4)


def _conv_inputs(lengths: list[int], channels: int = 12, width: int = 4, seed: int = 0, dtype=torch.float32):
    g = _gen(seed)
    x = torch.randn(sum(lengths) + 2, channels, generator=g).to(dtype)
    weight = torch.randn(channels, width, generator=g).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return x, weight, qsl


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv1d_matches_reference(dtype):
    lengths = [1, 2, 9, 1, 4]
    x, weight, qsl = _conv_inputs(lengths, dtype=dtype)
    slots = torch.tensor([3, 0, 1, -1, 4], dtype=torch.int32)
    start = torch.randn(6, 12, 3, generator=_gen(9)).to(dtype)
    ours_state, ref_state = start.clone(), start.clone()
    ours = pagedserve.causal_conv1d(x, weight, ours_state, qsl, slots, True)
    ref = reference_causal_conv1d(x, weight, ref_state, qsl, slots, True)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(ours, ref, **tol)
    torch.testing.assert_close(ours_state, ref_state, atol=0, rtol=0)
    assert torch.equal(ours_state[[2, 5]], start[[2, 5]])
    assert ours[int(qsl[3])].abs().max() == 0 and ours[-2:].abs().max() == 0


def test_causal_conv1d_from_zero_state_in_pieces_matches_transformers():
    x, weight, _ = _conv_inputs([11], seed=2)
    x = x[:11]
    theirs = causal_conv1d_fn(x.T[None], weight, None, activation="silu")[0].T
    state, pieces = torch.zeros(1, 12, 3), []
    for a, b in [(0, 2), (2, 3), (3, 4), (4, 11)]:
        pieces.append(pagedserve.causal_conv1d(x[a:b], weight, state, torch.tensor([0, b - a], dtype=torch.int32),
                                               torch.tensor([0], dtype=torch.int32), True))
    torch.testing.assert_close(torch.cat(pieces), theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[0], x[-3:].T, atol=0, rtol=0)


# checkpoint rows: a verify-like row, a decode row, a row past one 64-chunk, and a slotless row (records
# nothing); the other rows record nothing either. Indexes leave gaps that must stay untouched.
CK_LENGTHS, CK_SLOTS = [1, 5, 70, 3, 1, 9], [4, 0, 2, -1, 1, 5]
CK_START, CK_SIZE = [-1, 0, 6, 80, 76, 78], 90


def _prefix_state(op, inputs: tuple, fixed: tuple, state: torch.Tensor, slot: int, a: int, n: int, *flags
                  ) -> torch.Tensor:
    """The slot's state after the reference ran on tokens a..a+n-1 only."""
    state = state.clone()
    op(*(x[a:a + n] for x in inputs), *fixed, state, torch.tensor([0, n], dtype=torch.int32),
       torch.tensor([slot], dtype=torch.int32), *flags)
    return state[slot]


def _check_checkpoints(op, reference, inputs: tuple, fixed: tuple, start_state: torch.Tensor, *flags, tol: dict):
    """op with checkpoints == op without (outputs, final states); checkpoint j of a recording row == the
    reference's state after the row's first j+1 tokens; unrecorded entries untouched; the reference's own
    checkpoints agree."""
    qsl = torch.tensor([0] + torch.tensor(CK_LENGTHS).cumsum(0).tolist(), dtype=torch.int32)
    slots, first = torch.tensor(CK_SLOTS, dtype=torch.int32), torch.tensor(CK_START, dtype=torch.int32)
    plain_state, ck_state = start_state.clone(), start_state.clone()
    plain = op(*inputs, *fixed, plain_state, qsl, slots, *flags)
    sentinel = torch.full((CK_SIZE, *start_state.shape[1:]), 7.0, dtype=start_state.dtype)
    checkpoints = sentinel.clone()
    recorded = op(*inputs, *fixed, ck_state, qsl, slots, *flags, checkpoints, first)
    torch.testing.assert_close(recorded, plain, **tol)
    torch.testing.assert_close(ck_state, plain_state, **tol)
    written = torch.zeros(CK_SIZE, dtype=torch.bool)
    for i, (n, slot, c) in enumerate(zip(CK_LENGTHS, CK_SLOTS, CK_START)):
        if c < 0 or slot < 0:
            continue
        written[c:c + n] = True
        for j in range(n):
            want = _prefix_state(reference, inputs, fixed, start_state, slot, int(qsl[i]), j + 1, *flags)
            torch.testing.assert_close(checkpoints[c + j], want, **tol, msg=f"row {i}, token {j}")
    assert torch.equal(checkpoints[~written], sentinel[~written])
    ref_checkpoints, ref_state = sentinel.clone(), start_state.clone()
    reference(*inputs, *fixed, ref_state, qsl, slots, *flags, ref_checkpoints, first)
    torch.testing.assert_close(checkpoints, ref_checkpoints, **tol)
    return checkpoints


def test_gated_delta_rule_checkpoints_hold_the_state_after_each_token():
    q, k, v, g, beta, _ = _delta_inputs(CK_LENGTHS, pad=2, seed=12)
    _check_checkpoints(pagedserve.gated_delta_rule, reference_gated_delta_rule, (q, k, v, g, beta), (), _states(7),
                       True, tol=dict(atol=2e-5, rtol=2e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv1d_checkpoints_hold_the_last_inputs_after_each_token(dtype):
    x, weight, _ = _conv_inputs(CK_LENGTHS, dtype=dtype, seed=13)
    start = torch.randn(7, 12, 3, generator=_gen(14)).to(dtype)
    _check_checkpoints(pagedserve.causal_conv1d, reference_causal_conv1d, (x,), (weight,), start, True,
                       tol=dict(atol=0, rtol=0))     # states are copies of inputs: exact


def test_checkpoint_arguments_are_checked():
    q, k, v, g, beta, qsl = _delta_inputs([3])
    slot = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(OpInputError, match="pass both or neither"):
        pagedserve.gated_delta_rule(q, k, v, g, beta, _states(1), qsl, slot, True, _states(3), None)
    with pytest.raises(OpInputError, match="like one state slot"):
        pagedserve.gated_delta_rule(q, k, v, g, beta, _states(1), qsl, slot, True, torch.zeros(3, 2),
                                    torch.tensor([0], dtype=torch.int32))
    with pytest.raises(OpInputError, match="past the 2 checkpoints given"):
        pagedserve.gated_delta_rule(q, k, v, g, beta, _states(1), qsl, slot, True, _states(2),
                                    torch.tensor([0], dtype=torch.int32))


@pytest.mark.parametrize("normalize", [True, False])
def test_moe_matches_reference(normalize):
    g = _gen(4)
    x = torch.randn(9, 16, generator=g)
    logits = torch.randn(9, 6, generator=g)
    gate_up, down = torch.randn(6, 20, 16, generator=g) * 0.3, torch.randn(6, 16, 10, generator=g) * 0.3
    weights, ids = pagedserve.moe_route(logits, 2, normalize)
    ref_w, ref_ids = reference_moe_route(logits, 2, normalize)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w)
    if normalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(9))
    torch.testing.assert_close(pagedserve.moe_experts(x, gate_up, down, weights, ids),
                               reference_moe_experts(x, gate_up, down, weights, ids), atol=1e-5, rtol=1e-5)


def test_state_slot_out_of_range_is_a_clear_error():
    q, k, v, g, beta, qsl = _delta_inputs([2])
    with pytest.raises(OpInputError, match="past the pool's 1 slots"):
        pagedserve.gated_delta_rule(q, k, v, g, beta, _states(1), qsl, torch.tensor([1], dtype=torch.int32), True)


def _opcheck_samples():
    q, k, v, g, beta, qsl = _delta_inputs([1, 5, 1], pad=1)
    x, weight, cqsl = _conv_inputs([1, 4, 2])
    gen = _gen(8)
    logits, xm = torch.randn(5, 4, generator=gen), torch.randn(5, 8, generator=gen)
    weights, ids = torch.rand(5, 2, generator=gen), torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 3]])
    first = torch.tensor([-1, 0, 5], dtype=torch.int32)
    return [
        (pagedserve.gated_delta_rule, (q, k, v, g, beta, _states(4), qsl, torch.tensor([3, 0, -1], dtype=torch.int32),
                                       True)),
        (pagedserve.gated_delta_rule, (q, k, v, g, beta, _states(4), qsl, torch.tensor([3, 0, 1], dtype=torch.int32),
                                       True, _states(6), first)),
        (pagedserve.causal_conv1d, (x, weight, torch.randn(3, 12, 3, generator=gen), cqsl,
                                    torch.tensor([2, 0, 1], dtype=torch.int32), True)),
        (pagedserve.causal_conv1d, (x, weight, torch.randn(3, 12, 3, generator=gen), cqsl,
                                    torch.tensor([2, 0, 1], dtype=torch.int32), True,
                                    torch.randn(7, 12, 3, generator=gen), first)),
        (pagedserve.moe_route, (logits, 2, True)),
        (pagedserve.moe_experts, (xm, torch.randn(4, 12, 8, generator=gen), torch.randn(4, 8, 6, generator=gen),
                                  weights, ids)),
    ]


@pytest.mark.parametrize("op, args", _opcheck_samples(), ids=lambda v: getattr(v, "__name__", ""))
def test_opcheck(op, args):
    torch.library.opcheck(op, args)
