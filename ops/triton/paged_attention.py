"""Triton `paged_attention`: one launch for the whole flat varlen batch (prefill chunks and decode rows).

A program owns one tile of up to BLOCK_Q query tokens of one row and one K/V head; the GQA query heads of
that K/V head ride along as extra rows of the tile (M = BLOCK_Q x GROUP_PAD), so every K/V page is loaded
once per tile. The program walks the row's block table page by page with an online softmax in fp32.
K/V may be stored in a narrower dtype than q: they are converted to q's dtype as they are loaded; or as
q8_0 / q4_0 rows in tiles of 16 slots (ops/kv_quant.py), dequantized as they are loaded. Quantized K is
stored Hadamard-rotated per 32-value block, so the launcher rotates q the same way first.
Long decode contexts use the split-K variant: each split walks a slice of the pages and writes its partial
(acc, max, sum) to fp32 scratch; a second kernel merges the splits. Nothing here reads tensors on the host,
so the launch is CUDA-graph safe and traceable by inductor.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ops import kv_quant
from ops.triton._launch import fp32_dot, launchable, mma, pow2, row_of_tile
from ops.triton.kv_quant import FORMAT_CODES, TILE, load_quantized, load_values

_MIN_DOT = 16             # tl.dot needs every dimension >= 16 on GPUs
_PREFILL_BLOCK_Q = 16
_SPLIT_MAX_TOKENS = 256   # split-K pays off when few tokens (decode) face long contexts
_SPLIT_KEYS = 1024        # keys per split we aim for


@triton.jit
def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, acc_ptr, ml_ptr, qsl_ptr, ctx_ptr, bt_ptr,
        scale, num_rows, num_tokens, pages_per_split,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_ot, stride_oh, stride_bt,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr, F32_DOT: tl.constexpr,
        FORMAT: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = row_of_tile(qsl_ptr, num_rows, tile, BLOCK_Q)
    row_start = tl.load(qsl_ptr + row)
    n = tl.load(qsl_ptr + row + 1) - row_start
    first = (tile - (row_start // BLOCK_Q + row)) * BLOCK_Q          # first token of this tile inside the row
    if first >= n:
        return
    ctx = tl.load(ctx_ptr + row)

    m = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tok = first + m // GROUP_PAD
    g = m % GROUP_PAD
    head = kv_head * GROUP + g
    m_ok = (tok < n) & (g < GROUP)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    token = row_start + tok
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = ctx - n + tok                                              # causal limit of each tile row

    last_pos = ctx - n + tl.minimum(first + BLOCK_Q, n) - 1
    num_pages = last_pos // PAGE + 1
    page_lo = split * pages_per_split
    page_hi = tl.minimum(num_pages, page_lo + pages_per_split)

    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, D_PAD], tl.float32)
    s = tl.arange(0, PAGE)
    for page in range(page_lo, page_hi):
        block = tl.load(bt_ptr + row * stride_bt + page).to(tl.int64)
        # a cache stored narrower than q (kv_cache_dtype) is widened as it is read, a quantized one dequantized
        if FORMAT == 0:
            k = load_values(k_ptr, block * stride_kb + s[:, None] * stride_ks + kv_head * stride_kh, d[None, :],
                            d_ok[None, :]).to(q.dtype)
            v = load_values(v_ptr, block * stride_vb + s[:, None] * stride_vs + kv_head * stride_vh, d[None, :],
                            d_ok[None, :]).to(q.dtype)
        else:             # tiles of TILE slots of one kv head, stride_kh bytes a slot's row (contiguous caches)
            tile = block * stride_kb + (kv_head * (PAGE // TILE) + s[:, None] // TILE) * (TILE * stride_kh)
            j = s[:, None] % TILE
            k = load_quantized(k_ptr, tile, j, d[None, :], d_ok[None, :], HEAD_DIM // 32, FORMAT, True).to(q.dtype)
            v = load_quantized(v_ptr, tile, j, d[None, :], d_ok[None, :], HEAD_DIM // 32, FORMAT, False).to(q.dtype)
        scores = mma(q, tl.trans(k), F32_DOT) * scale
        k_pos = page * PAGE + s
        scores = tl.where(k_pos[None, :] <= q_pos[:, None], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)          # fully masked tile rows stay at zero
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, F32_DOT)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    else:
        # scratch layout: acc [S, T, Hq, D_PAD], ml [S, T, Hq, 2]
        heads = GROUP * tl.num_programs(1)
        cell = (split * num_tokens + token) * heads + head
        tl.store(acc_ptr + cell[:, None] * D_PAD + d[None, :], acc, mask=m_ok[:, None])
        tl.store(ml_ptr + cell * 2, m_i, mask=m_ok)
        tl.store(ml_ptr + cell * 2 + 1, l_i, mask=m_ok)


@triton.jit
def _merge_splits_kernel(out_ptr, acc_ptr, ml_ptr, qsl_ptr, num_rows, num_tokens, stride_ot, stride_oh,
                         HEADS: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                         NUM_SPLITS: tl.constexpr):
    token = tl.program_id(0)
    if token >= tl.load(qsl_ptr + num_rows):
        return                                                         # padding tokens keep their zeros
    sp = tl.arange(0, NUM_SPLITS)[:, None]
    h = tl.arange(0, H_PAD)[None, :]
    h_ok = h < HEADS
    cell = (sp * num_tokens + token) * HEADS + h                       # [S, H]
    m_s = tl.load(ml_ptr + cell * 2, mask=h_ok, other=float("-inf"))
    l_s = tl.load(ml_ptr + cell * 2 + 1, mask=h_ok, other=0.0)
    m_max = tl.max(m_s, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp(m_s - m_max[None, :])                                   # [S, H]
    d = tl.arange(0, D_PAD)[None, None, :]
    acc = tl.load(acc_ptr + cell[:, :, None] * D_PAD + d, mask=h_ok[:, :, None], other=0.0)
    total = tl.sum(w * l_s, 0)
    out = tl.sum(acc * w[:, :, None], 0) / tl.where(total == 0.0, 1.0, total)[:, None]     # [H, D]
    oh = tl.arange(0, H_PAD)[:, None]
    od = tl.arange(0, D_PAD)[None, :]
    tl.store(out_ptr + token * stride_ot + oh * stride_oh + od, out.to(out_ptr.dtype.element_ty),
             mask=(oh < HEADS) & (od < HEAD_DIM))


def default_num_splits(num_tokens: int, max_blocks: int, block_size: int) -> int:
    """Split-K only for few query tokens against long block tables (decidable from shapes alone)."""
    if num_tokens > _SPLIT_MAX_TOKENS:
        return 1
    return pow2(min(16, max(1, max_blocks * block_size // _SPLIT_KEYS)))


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, query_start_loc: Tensor, context_lens: Tensor,
                    block_tables: Tensor, scale: float, *, block_q: int | None = None,
                    num_splits: int | None = None) -> Tensor:
    """Same contract as `pagedserve::paged_attention`. `block_q` (query tokens per tile) and `num_splits`
    (split-K; a power of two) only change speed: by default 1 token per tile when no row can hold more than
    one token on average (decode steps), 16 otherwise, and split-K from `default_num_splits`."""
    fmt = kv_quant.format_of(k_cache, q.shape[-1])
    if fmt:
        q = kv_quant.rotate(q).to(q.dtype)
    if q.stride(-1) != 1:
        q = q.contiguous()
    num_tokens, q_heads, head_dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    num_rows, max_blocks = block_tables.shape
    group = q_heads // kv_heads
    if block_q is None:
        block_q = 1 if num_tokens <= num_rows else _PREFILL_BLOCK_Q
    num_splits = default_num_splits(num_tokens, max_blocks, page) if num_splits is None else pow2(num_splits)
    group_pad = max(pow2(group), _MIN_DOT // block_q)
    d_pad = pow2(head_dim, _MIN_DOT)
    out = torch.zeros_like(q)                                          # tokens past qsl[-1] stay zero
    if num_rows == 0 or num_tokens == 0:
        return out
    if num_splits > 1:
        acc = torch.empty(num_splits, num_tokens, q_heads, d_pad, dtype=torch.float32, device=q.device)
        ml = torch.empty(num_splits, num_tokens, q_heads, 2, dtype=torch.float32, device=q.device)
    else:
        acc = ml = out                                                 # unused by the single-split path
    tiles = num_tokens // block_q + num_rows
    launchable(_paged_attention_kernel)[(tiles, kv_heads, num_splits)](
        q, k_cache, v_cache, out, acc, ml, query_start_loc, context_lens, block_tables,
        scale, num_rows, num_tokens, triton.cdiv(max_blocks, num_splits),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, HEAD_DIM=head_dim, D_PAD=d_pad, PAGE=page,
        NUM_SPLITS=num_splits, F32_DOT=fp32_dot(q.dtype), FORMAT=FORMAT_CODES[fmt])
    if num_splits > 1:
        launchable(_merge_splits_kernel)[(num_tokens,)](
            out, acc, ml, query_start_loc, num_rows, num_tokens, out.stride(0), out.stride(1),
            HEADS=q_heads, H_PAD=pow2(q_heads), HEAD_DIM=head_dim, D_PAD=d_pad, NUM_SPLITS=num_splits)
    return out
