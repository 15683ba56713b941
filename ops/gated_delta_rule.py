"""`pagedserve::gated_delta_rule`: Gated DeltaNet linear attention over a flat varlen batch, state by slot.

Row i owns tokens qsl[i]:qsl[i+1] and the recurrent state `state_pool[state_slots[i]]` ([Hv, Dk, Dv], fp32),
which it reads as the state before its first token and overwrites with the state after its last token, so a
prompt split over several steps continues exactly. Per token t and value head h (q/k head h // (Hv / Hk)):

    S = exp(g_t) * S;   S += k_t (beta_t * (v_t - S^T k_t))^T;   o_t = S^T q_t

with q, k L2-normalised (when `use_qk_l2norm`) and q scaled by Dk^-0.5. Multi-token rows use the chunked
(WY / UT-transform) form, single-token rows one batched recurrent step. Rows with slot < 0 and tokens past
qsl[-1] (padding) read and write no state and produce zeros.

Optionally a row also records the state after each of its tokens: with `checkpoints` [N, Hv, Dk, Dv] and
`checkpoint_start[i] = c >= 0`, the state after row i's j-th token goes to checkpoints[c + j]. Such rows
(speculative verify rows: a few tokens) run in the recurrent form, one batched step per token, which is
the computation single-token decode steps do, so a rolled-back state is what plain decoding would hold.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ops import pointwise
from ops._registry import (NAMESPACE, checkpoint_rows, impl, register, require, require_checkpoints,
                           require_slot_rows)

CHUNK = 64


def _check(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor,
           query_start_loc: Tensor, state_slots: Tensor, checkpoints: Tensor | None,
           checkpoint_start: Tensor | None) -> None:
    op = "gated_delta_rule"
    require(q.dim() == 3 and k.shape == q.shape, op,
            f"q and k must both be [T, Hk, Dk], got q {tuple(q.shape)}, k {tuple(k.shape)}")
    t, hk, dk = q.shape
    require(v.dim() == 3 and v.shape[0] == t and v.shape[1] % hk == 0, op,
            f"v must be [T={t}, Hv, Dv] with Hv a multiple of Hk={hk}, got {tuple(v.shape)}")
    hv, dv = v.shape[1], v.shape[2]
    require(g.shape == (t, hv) and beta.shape == (t, hv), op,
            f"g and beta must be [T={t}, Hv={hv}], got g {tuple(g.shape)}, beta {tuple(beta.shape)}")
    require(state_pool.dim() == 4 and state_pool.shape[1:] == (hv, dk, dv) and state_pool.dtype == torch.float32,
            op, f"state_pool must be fp32 [slots, Hv={hv}, Dk={dk}, Dv={dv}], "
                f"got {state_pool.dtype} {tuple(state_pool.shape)}")
    require_slot_rows(op, state_slots, query_start_loc)
    require_checkpoints(op, checkpoints, checkpoint_start, state_pool, state_slots)


def _check_rows(starts: list[int], slots: list[int], num_tokens: int, num_slots: int) -> None:
    op = "gated_delta_rule"
    require(starts[0] == 0 and starts[-1] <= num_tokens and all(a <= b for a, b in zip(starts, starts[1:])), op,
            f"query_start_loc must start at 0, be non-decreasing and end at most at T={num_tokens}, got {starts}")
    bad = [s for s in slots if s >= num_slots]
    require(not bad, op, f"state slot {bad[0] if bad else 0} is past the pool's {num_slots} slots (-1 = no state)")


def _prepare(q: Tensor, k: Tensor, heads_v: int, use_qk_l2norm: bool) -> tuple[Tensor, Tensor]:
    """fp32 q, k with one head per value head; normalised like the fla kernels (rsqrt(sum sq + 1e-6))."""
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q = q * pointwise.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * pointwise.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    group = heads_v // q.shape[1]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    return q, k


def reference_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor,
                               query_start_loc: Tensor, state_slots: Tensor, use_qk_l2norm: bool,
                               checkpoints: Tensor | None = None, checkpoint_start: Tensor | None = None) -> Tensor:
    """The definition, one token at a time; mutates `state_pool` (and `checkpoints`) like the op."""
    qf, kf = _prepare(q, k, v.shape[1], use_qk_l2norm)
    out = torch.zeros(v.shape, dtype=torch.float32)
    starts = query_start_loc.tolist()
    first = checkpoint_rows(checkpoints, checkpoint_start, starts, "gated_delta_rule")
    for i, slot in enumerate(state_slots.tolist()):
        if slot < 0:
            continue
        state = state_pool[slot].clone()
        for t in range(starts[i], starts[i + 1]):
            for h in range(v.shape[1]):
                s = state[h] * torch.exp(g[t, h].float())
                delta = beta[t, h].float() * (v[t, h].float() - s.T @ kf[t, h])
                state[h] = s + torch.outer(kf[t, h], delta)
                out[t, h] = state[h].T @ qf[t, h]
            if first[i] >= 0:
                checkpoints[first[i] + t - starts[i]] = state
        state_pool[slot] = state
    return out.to(v.dtype)


def _recurrent_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
                    ) -> tuple[Tensor, Tensor]:
    """One token for R rows at once: q, k [R, H, Dk], v [R, H, Dv], g, beta [R, H], state [R, H, Dk, Dv]."""
    state = state * g.exp()[..., None, None]
    predicted = torch.einsum("rhkv,rhk->rhv", state, k)
    state = state + k[..., :, None] * (beta[..., None] * (v - predicted))[..., None, :]
    return torch.einsum("rhkv,rhk->rhv", state, q), state


def _chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """One multi-token row: q, k [H, n, Dk], v [H, n, Dv], g, beta [H, n], state [H, Dk, Dv] (all fp32).

    Within a chunk the delta-rule updates form a unit lower-triangular system (the UT transform): solving it
    once gives every token's corrected value, so a chunk costs a few matmuls instead of C state updates.
    Padding tokens (k = 0, beta = 0, g = 0) change nothing.
    """
    heads, n = q.shape[0], q.shape[1]
    pad = (-n) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)).view(heads, -1, CHUNK, x.shape[-1]) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)).view(heads, -1, CHUNK) for x in (g, beta))
    log_decay = g.cumsum(-1)                                           # [H, N, C]: decay from chunk start
    future = torch.ones(CHUNK, CHUNK, dtype=torch.bool).triu(1)
    # exp(cum_i - cum_j) for j <= i; masked before exp so the (positive) upper part cannot overflow
    pair_decay = (log_decay[..., :, None] - log_decay[..., None, :]).masked_fill(future, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * pair_decay               # diagonal ignored: unitriangular
    values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    state_keys = torch.linalg.solve_triangular(system, k_beta * log_decay.exp()[..., None],
                                               upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * pair_decay
    q_decayed = q * log_decay.exp()[..., None]
    k_to_end = k * (log_decay[..., -1:] - log_decay).exp()[..., None]
    chunk_decay = log_decay[..., -1].exp()
    out = torch.empty_like(v)
    for c in range(q.shape[1]):
        corrected = values[:, c] - state_keys[:, c] @ state
        out[:, c] = q_decayed[:, c] @ state + intra[:, c] @ corrected
        state = state * chunk_decay[:, c, None, None] + k_to_end[:, c].transpose(-1, -2) @ corrected
    return out.reshape(heads, -1, v.shape[-1])[:, :n], state


def _recurrent_rows(rows: list[int], starts: list[int], slots: list[int], first: list[int], inputs: tuple,
                    state_pool: Tensor, out: Tensor, checkpoints: Tensor | None) -> None:
    """Rows in the recurrent form, one batched step per token position (the rows still that long)."""
    dev = out.device
    lengths = [starts[i + 1] - starts[i] for i in rows]
    idx = torch.tensor([slots[i] for i in rows], dtype=torch.long, device=dev)
    state = state_pool.index_select(0, idx)
    for j in range(max(lengths)):
        live = [r for r, n in enumerate(lengths) if n > j]
        tok = torch.tensor([starts[rows[r]] + j for r in live], dtype=torch.long, device=dev)
        sub = None if len(live) == len(rows) else torch.tensor(live, dtype=torch.long, device=dev)
        o, new = _recurrent_step(*(x[tok] for x in inputs), state if sub is None else state[sub])
        out.index_copy_(0, tok, o)
        state = new if sub is None else state.index_copy(0, sub, new)
        recorded = [(n, first[rows[r]] + j) for n, r in enumerate(live) if first[rows[r]] >= 0]
        if recorded:
            checkpoints.index_copy_(0, torch.tensor([c for _, c in recorded], dtype=torch.long, device=dev),
                                    new[torch.tensor([n for n, _ in recorded], dtype=torch.long, device=dev)])
    state_pool.index_copy_(0, idx, state)


@register("gated_delta_rule", "cpu")
def torch_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor,
                           query_start_loc: Tensor, state_slots: Tensor, use_qk_l2norm: bool,
                           checkpoints: Tensor | None = None, checkpoint_start: Tensor | None = None) -> Tensor:
    starts, slots = query_start_loc.tolist(), state_slots.tolist()
    _check_rows(starts, slots, q.shape[0], state_pool.shape[0])
    first = checkpoint_rows(checkpoints, checkpoint_start, starts, "gated_delta_rule")
    qf, kf = _prepare(q, k, v.shape[1], use_qk_l2norm)
    vf, gf, bf = v.float(), g.float(), beta.float()
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    lengths = [b - a for a, b in zip(starts, starts[1:])]
    recurrent = [i for i, s in enumerate(slots) if s >= 0 and (lengths[i] == 1 or (lengths[i] and first[i] >= 0))]
    if recurrent:
        _recurrent_rows(recurrent, starts, slots, first, (qf, kf, vf, gf, bf), state_pool, out, checkpoints)
    for i, slot in enumerate(slots):
        a, b = starts[i], starts[i + 1]
        if slot < 0 or b - a < 2 or first[i] >= 0:
            continue
        o, new = _chunked(*(x[a:b].transpose(0, 1) for x in (qf, kf, vf, gf, bf)), state_pool[slot])
        out[a:b] = o.transpose(0, 1)
        state_pool[slot] = new
    return out.to(v.dtype)


@torch.library.custom_op(f"{NAMESPACE}::gated_delta_rule", mutates_args=("state_pool", "checkpoints"))
def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor,
                     query_start_loc: Tensor, state_slots: Tensor, use_qk_l2norm: bool,
                     checkpoints: Optional[Tensor] = None, checkpoint_start: Optional[Tensor] = None) -> Tensor:
    _check(q, k, v, g, beta, state_pool, query_start_loc, state_slots, checkpoints, checkpoint_start)
    return impl("gated_delta_rule", q.device)(q, k, v, g, beta, state_pool, query_start_loc, state_slots,
                                              use_qk_l2norm, checkpoints, checkpoint_start)


@gated_delta_rule.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor, query_start_loc: Tensor,
      state_slots: Tensor, use_qk_l2norm: bool, checkpoints: Optional[Tensor] = None,
      checkpoint_start: Optional[Tensor] = None) -> Tensor:
    _check(q, k, v, g, beta, state_pool, query_start_loc, state_slots, checkpoints, checkpoint_start)
    return torch.empty_like(v)
