"""`pagedserve::causal_conv1d`: depthwise causal convolution over a flat varlen batch, with a conv-state pool.

Row i owns tokens qsl[i]:qsl[i+1]; `conv_state[state_slots[i]]` ([C, K-1]) holds the row's K-1 inputs
before its first token (zeros for a fresh sequence) and is overwritten with its last K-1 inputs, so prompt
chunks and single-token decode steps continue exactly. Output channel c at token t is
sum_j weight[c, j] * input[c, t - (K-1) + j], optionally followed by SiLU. Rows with slot < 0 and padding
tokens past qsl[-1] touch no state and produce zeros.

Optionally a row also records the state after each of its tokens: with `checkpoints` [N, C, K-1] and
`checkpoint_start[i] = c >= 0`, the state after row i's j-th token (its last K-1 inputs up to that token,
the slot's old state in front) goes to checkpoints[c + j]. Speculative decoding rolls a hybrid model's
slot back to one of them when proposals are rejected (engine/state_rollback.py).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ops import pointwise
from ops._registry import (NAMESPACE, checkpoint_rows, impl, register, require, require_checkpoints,
                           require_slot_rows)


def _check(x: Tensor, weight: Tensor, conv_state: Tensor, query_start_loc: Tensor, state_slots: Tensor,
           checkpoints: Tensor | None, checkpoint_start: Tensor | None) -> None:
    op = "causal_conv1d"
    require(x.dim() == 2, op, f"x must be [T, C], got {tuple(x.shape)}")
    channels = x.shape[1]
    require(weight.dim() == 2 and weight.shape[0] == channels and weight.shape[1] >= 2, op,
            f"weight must be [C={channels}, K>=2], got {tuple(weight.shape)}")
    width = weight.shape[1] - 1
    require(conv_state.dim() == 3 and conv_state.shape[1:] == (channels, width), op,
            f"conv_state must be [slots, C={channels}, K-1={width}], got {tuple(conv_state.shape)}")
    require(x.dtype == weight.dtype == conv_state.dtype, op,
            f"x, weight and conv_state must share a dtype, got {x.dtype}, {weight.dtype}, {conv_state.dtype}")
    require_slot_rows(op, state_slots, query_start_loc)
    require_checkpoints(op, checkpoints, checkpoint_start, conv_state, state_slots)


def reference_causal_conv1d(x: Tensor, weight: Tensor, conv_state: Tensor, query_start_loc: Tensor,
                            state_slots: Tensor, apply_silu: bool, checkpoints: Tensor | None = None,
                            checkpoint_start: Tensor | None = None) -> Tensor:
    out = torch.zeros(x.shape, dtype=torch.float32)
    starts = query_start_loc.tolist()
    first = checkpoint_rows(checkpoints, checkpoint_start, starts, "causal_conv1d")
    width = conv_state.shape[2]
    for i, slot in enumerate(state_slots.tolist()):
        if slot < 0:
            continue
        history = [conv_state[slot, :, j].float() for j in range(width)]
        for t in range(starts[i], starts[i + 1]):
            history.append(x[t].float())
            window = torch.stack(history[-weight.shape[1]:], dim=1)          # [C, K]
            value = (window * weight.float()).sum(1)
            out[t] = value * torch.sigmoid(value) if apply_silu else value
            if first[i] >= 0:
                checkpoints[first[i] + t - starts[i]] = torch.stack(history[-width:], dim=1).to(checkpoints.dtype)
        conv_state[slot] = torch.stack(history[-width:], dim=1).to(conv_state.dtype)
    return out.to(x.dtype)


def _convolve(windows: Tensor, weight: Tensor, apply_silu: bool) -> Tensor:
    """windows [R, C, L] -> [R, C, L - K + 1]. A sum over the K taps in fp32: depthwise F.conv1d has
    no fast CPU path in bf16 (~600 ms for one token of 6,144 channels, against well under 1 ms)."""
    taps, length = weight.shape[1], windows.shape[2] - weight.shape[1] + 1
    w = weight.float()
    out = sum(windows[:, :, j:j + length].float() * w[:, j, None] for j in range(taps))
    out = pointwise.silu(out) if apply_silu else out
    return out.to(windows.dtype)


@register("causal_conv1d", "cpu")
def torch_causal_conv1d(x: Tensor, weight: Tensor, conv_state: Tensor, query_start_loc: Tensor,
                        state_slots: Tensor, apply_silu: bool, checkpoints: Tensor | None = None,
                        checkpoint_start: Tensor | None = None) -> Tensor:
    starts, slots = query_start_loc.tolist(), state_slots.tolist()
    require(starts[0] == 0 and starts[-1] <= x.shape[0] and all(a <= b for a, b in zip(starts, starts[1:])),
            "causal_conv1d", f"query_start_loc must start at 0, be non-decreasing and end at most at "
                             f"T={x.shape[0]}, got {starts}")
    bad = [s for s in slots if s >= conv_state.shape[0]]
    require(not bad, "causal_conv1d",
            f"state slot {bad[0] if bad else 0} is past the pool's {conv_state.shape[0]} slots (-1 = no state)")
    first = checkpoint_rows(checkpoints, checkpoint_start, starts, "causal_conv1d")
    out = torch.zeros_like(x)
    decode = [i for i, s in enumerate(slots) if s >= 0 and starts[i + 1] - starts[i] == 1 and first[i] < 0]
    if decode:
        tok = torch.tensor([starts[i] for i in decode], dtype=torch.long, device=x.device)
        idx = torch.tensor([slots[i] for i in decode], dtype=torch.long, device=x.device)
        windows = torch.cat([conv_state.index_select(0, idx), x.index_select(0, tok)[:, :, None]], dim=2)
        out.index_copy_(0, tok, _convolve(windows, weight, apply_silu)[:, :, 0])
        conv_state.index_copy_(0, idx, windows[:, :, 1:])
    width = conv_state.shape[2]
    for i, slot in enumerate(slots):
        a, b = starts[i], starts[i + 1]
        if slot < 0 or b == a or (b - a == 1 and first[i] < 0):
            continue
        window = torch.cat([conv_state[slot], x[a:b].transpose(0, 1)], dim=1)   # [C, K-1+n]
        out[a:b] = _convolve(window[None], weight, apply_silu)[0].transpose(0, 1)
        if first[i] >= 0:   # the state after token j is window[:, j+1 : j+K]
            checkpoints[first[i]:first[i] + b - a] = window.unfold(1, width, 1)[:, 1:].transpose(0, 1)
        conv_state[slot] = window[:, -width:]
    return out


@torch.library.custom_op(f"{NAMESPACE}::causal_conv1d", mutates_args=("conv_state", "checkpoints"))
def causal_conv1d(x: Tensor, weight: Tensor, conv_state: Tensor, query_start_loc: Tensor, state_slots: Tensor,
                  apply_silu: bool, checkpoints: Optional[Tensor] = None,
                  checkpoint_start: Optional[Tensor] = None) -> Tensor:
    _check(x, weight, conv_state, query_start_loc, state_slots, checkpoints, checkpoint_start)
    return impl("causal_conv1d", x.device)(x, weight, conv_state, query_start_loc, state_slots, apply_silu,
                                           checkpoints, checkpoint_start)


@causal_conv1d.register_fake
def _(x: Tensor, weight: Tensor, conv_state: Tensor, query_start_loc: Tensor, state_slots: Tensor,
      apply_silu: bool, checkpoints: Optional[Tensor] = None, checkpoint_start: Optional[Tensor] = None) -> Tensor:
    _check(x, weight, conv_state, query_start_loc, state_slots, checkpoints, checkpoint_start)
    return torch.empty_like(x)
