"""Triton `causal_conv1d`: depthwise causal convolution of a flat varlen batch with a conv-state pool.

A program owns a tile of BLOCK_T tokens of one row and a block of channels (tiles found like
paged_attention's, so prefill chunks and decode rows share one launch). Only a row's first tile reads the
old state (BLOCK_T >= K-1, so earlier inputs of later tiles are all in x), and that same program writes the
new state after a barrier: no other program can see a half-updated state. A row that records checkpoints
stores, for each of its tokens, the K-1 inputs ending there, which the tap loop loads anyway.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ops.triton._launch import launchable, pow2, row_of_tile

_BLOCK_C = 64
_PREFILL_BLOCK_T = 16


@triton.jit
def _causal_conv1d_kernel(x_ptr, w_ptr, state_ptr, out_ptr, qsl_ptr, slot_ptr, ckpt_ptr, ckpt_start_ptr, num_rows,
                          stride_xt, stride_wc, stride_ss, stride_sc, stride_ot, stride_cks, stride_ckc,
                          CHANNELS: tl.constexpr, K: tl.constexpr, W_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_C: tl.constexpr, APPLY_SILU: tl.constexpr, CHECKPOINTS: tl.constexpr):
    tile = tl.program_id(0)
    row = row_of_tile(qsl_ptr, num_rows, tile, BLOCK_T)
    row_start = tl.load(qsl_ptr + row)
    n = tl.load(qsl_ptr + row + 1) - row_start
    slot = tl.load(slot_ptr + row).to(tl.int64)
    first = (tile - (row_start // BLOCK_T + row)) * BLOCK_T
    if (first >= n) | (slot < 0):
        return
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < CHANNELS
    tok = first + tl.arange(0, BLOCK_T)
    t_ok = tok < n
    state = state_ptr + slot * stride_ss + c[None, :] * stride_sc
    ckpt = tl.full([], -1, tl.int64)
    if CHECKPOINTS:
        ckpt = tl.load(ckpt_start_ptr + row).to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for j in tl.static_range(K):
        src = tok - (K - 1) + j                                        # input index inside the row; < 0: state
        ok = t_ok[:, None] & c_ok[None, :]
        from_x = tl.load(x_ptr + (row_start + src)[:, None] * stride_xt + c[None, :],
                         mask=ok & (src >= 0)[:, None], other=0.0)
        from_state = tl.load(state + (K - 1 + src)[:, None], mask=ok & (src < 0)[:, None], other=0.0)
        w = tl.load(w_ptr + c * stride_wc + j, mask=c_ok, other=0.0).to(tl.float32)
        acc += (from_x.to(tl.float32) + from_state.to(tl.float32)) * w[None, :]
        if CHECKPOINTS:
            if j > 0:   # the state after token t holds its inputs t-(K-2)..t: taps 1..K-1, in order
                if ckpt >= 0:
                    tl.store(ckpt_ptr + (ckpt + tok)[:, None] * stride_cks + c[None, :] * stride_ckc + (j - 1),
                             (from_x + from_state).to(ckpt_ptr.dtype.element_ty), mask=ok)
    if APPLY_SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + (row_start + tok)[:, None] * stride_ot + c[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & c_ok[None, :])
    if first == 0:
        # new state column j = the row's input n-(K-1)+j: from x, or from the old state for short rows
        j = tl.arange(0, W_PAD)
        src = n - (K - 1) + j
        ok = (j < K - 1)[:, None] & c_ok[None, :]
        new = (tl.load(x_ptr + (row_start + src)[:, None] * stride_xt + c[None, :],
                       mask=ok & (src >= 0)[:, None], other=0.0)
               + tl.load(state + (K - 1 + src)[:, None], mask=ok & (src < 0)[:, None], other=0.0))
        tl.debug_barrier()                                             # every old-state read is done
        tl.store(state + j[:, None], new.to(state_ptr.dtype.element_ty), mask=ok)


def causal_conv1d(x: Tensor, weight: Tensor, conv_state: Tensor, query_start_loc: Tensor, state_slots: Tensor,
                  apply_silu: bool, checkpoints: Tensor | None = None, checkpoint_start: Tensor | None = None, *,
                  block_t: int | None = None) -> Tensor:
    """Same contract as `pagedserve::causal_conv1d`. `block_t` (tokens per tile, >= K-1) only changes speed."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    num_tokens, channels = x.shape
    num_rows, width = state_slots.shape[0], weight.shape[1]
    if block_t is None:
        block_t = 1 if num_tokens <= num_rows else _PREFILL_BLOCK_T
    block_t = pow2(block_t, width - 1)
    out = torch.zeros_like(x)                                          # padding tokens and slot -1 rows: zeros
    if num_rows == 0 or num_tokens == 0:
        return out
    block_c = min(_BLOCK_C, pow2(channels))
    record = checkpoints is not None
    ckpt = checkpoints if record else conv_state            # not read without CHECKPOINTS
    launchable(_causal_conv1d_kernel)[(num_tokens // block_t + num_rows, triton.cdiv(channels, block_c))](
        x, weight, conv_state, out, query_start_loc, state_slots, ckpt,
        checkpoint_start if record else state_slots, num_rows,
        x.stride(0), weight.stride(0), conv_state.stride(0), conv_state.stride(1), out.stride(0),
        ckpt.stride(0), ckpt.stride(1),
        CHANNELS=channels, K=width, W_PAD=pow2(width - 1), BLOCK_T=block_t, BLOCK_C=block_c,
        APPLY_SILU=apply_silu, CHECKPOINTS=record)
    return out
