"""`pagedserve::paged_attention`: causal GQA attention of a flat varlen batch against the paged K/V cache.

Row i owns q[qsl[i]:qsl[i+1]] (n_i tokens at positions ctx_i - n_i .. ctx_i - 1); its keys/values for
positions 0 .. ctx_i - 1 are already in the cache, position p at block_tables[i][p // BS], offset p % BS.
The cache may be stored in a narrower dtype than q (ops.write_kv.KV_CACHE_DTYPES): K/V are widened as they
are read, and the output has q's dtype. Or it holds block-quantized q8_0 / q4_0 rows (uint8, arranged in tiles:
ops/kv_quant.py): K/V are dequantized as they are read, and since quantized K is stored Hadamard-rotated per
32-value block, q is rotated the same way before it meets K (scores are unchanged in exact arithmetic).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ops import kv_quant
from ops._registry import NAMESPACE, impl, register, require
from ops.write_kv import check_cache_dtype


def _check(q: Tensor, k_cache: Tensor, v_cache: Tensor, query_start_loc: Tensor, context_lens: Tensor,
           block_tables: Tensor) -> None:
    op = "paged_attention"
    require(q.dim() == 3, op, f"q must be [T, Hq, D], got {tuple(q.shape)}")
    require(k_cache.dim() == 4 and v_cache.shape == k_cache.shape, op,
            f"k_cache and v_cache must both be [NB, BS, Hk, D or row bytes], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    require(q.shape[1] % k_cache.shape[2] == 0, op,
            f"q heads {q.shape[1]} must be a multiple of cache heads {k_cache.shape[2]}")
    require(q.is_floating_point(), op, f"q must be a floating tensor, got {q.dtype}")
    check_cache_dtype(op, k_cache, v_cache, q.shape[2])
    rows = context_lens.shape[0] if context_lens.dim() == 1 else -1
    require(context_lens.dtype == torch.int32 and rows >= 0, op,
            f"context_lens must be int32 [B], got {context_lens.dtype} {tuple(context_lens.shape)}")
    require(query_start_loc.dtype == torch.int32 and query_start_loc.shape == (rows + 1,), op,
            f"query_start_loc must be int32 [B+1={rows + 1}], "
            f"got {query_start_loc.dtype} {tuple(query_start_loc.shape)}")
    require(block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.shape[0] == rows, op,
            f"block_tables must be int32 [B={rows}, max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}")


def _check_lengths(starts: list[int], ctx: list[int], num_tokens: int, table_positions: int) -> None:
    op = "paged_attention"
    for i, n_ctx in enumerate(ctx):
        n = starts[i + 1] - starts[i]
        require(0 <= n <= n_ctx <= table_positions, op,
                f"row {i}: needs 0 <= new tokens ({n}) <= context_lens ({n_ctx}) <= max_blocks * block_size "
                f"({table_positions}); query_start_loc must be non-decreasing")
    require(starts[0] == 0 and starts[-1] <= num_tokens, op,
            f"query_start_loc must start at 0 and end at most at T={num_tokens}, got {starts[0]} .. {starts[-1]}")


def gather_kv(k_cache: Tensor, v_cache: Tensor, blocks: Tensor, dtype: torch.dtype,
              head_dim: int) -> tuple[Tensor, Tensor]:
    """K and V of cache `blocks` in `dtype`, [n, BS, Hk, D]: widened, or dequantized (K still rotated)."""
    keys, values = k_cache.index_select(0, blocks), v_cache.index_select(0, blocks)
    fmt = kv_quant.format_of(k_cache, head_dim)
    if fmt:
        return kv_quant.dequantize_kv(keys, values, fmt, dtype)
    return keys.to(dtype), values.to(dtype)


def queries_for(q: Tensor, k_cache: Tensor) -> Tensor:
    """q as it meets the stored keys: rotated like quantized K, else as it is."""
    return kv_quant.rotate(q).to(q.dtype) if kv_quant.format_of(k_cache, q.shape[-1]) else q


def reference_paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, query_start_loc: Tensor,
                              context_lens: Tensor, block_tables: Tensor, scale: float) -> Tensor:
    """In float64 on the K/V as stored (i.e. after their rounding to the cache dtype). A quantized cache is
    dequantized and its K rotated back (the rotation is its own inverse), so q is used as it is."""
    fmt = kv_quant.format_of(k_cache, q.shape[-1])
    if fmt:
        k_cache, v_cache = kv_quant.dequantize_kv(k_cache, v_cache, fmt, torch.float64)
        k_cache = kv_quant.rotate(k_cache)
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    starts = query_start_loc.tolist()
    for i, n_ctx in enumerate(context_lens.tolist()):
        n = starts[i + 1] - starts[i]
        for j in range(n):
            pos = n_ctx - n + j
            keys = torch.stack([k_cache[block_tables[i, p // block_size], p % block_size] for p in range(pos + 1)])
            values = torch.stack([v_cache[block_tables[i, p // block_size], p % block_size] for p in range(pos + 1)])
            for h in range(q.shape[1]):
                scores = keys[:, h // group].double() @ q[starts[i] + j, h].double() * scale
                out[starts[i] + j, h] = torch.softmax(scores, dim=0) @ values[:, h // group].double()
    return out.to(q.dtype)


def _decode_rows(out: Tensor, q: Tensor, k_cache: Tensor, v_cache: Tensor, rows: list[int], starts: list[int],
                 ctx: list[int], block_tables: Tensor, scale: float) -> None:
    """All single-token rows at once: one block gather of their K/V padded to the longest context, one masked
    attention. A kv head's G query heads play the role of G query tokens, so K/V are never repeated per head.
    """
    block_size, kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], q.shape[2]
    num_rows, group = len(rows), q.shape[1] // kv_heads
    lens = torch.tensor([ctx[r] for r in rows], dtype=torch.long)
    num_blocks = (int(lens.max()) + block_size - 1) // block_size
    blocks = block_tables.index_select(0, torch.tensor(rows, dtype=torch.long))[:, :num_blocks].long()
    used = torch.arange(num_blocks)[None, :] * block_size < lens[:, None]
    blocks = torch.where(used, blocks, 0).flatten()      # table entries past a row's context may be junk
    padded = num_blocks * block_size
    keys, values = (x.view(num_rows, padded, kv_heads, head_dim).transpose(1, 2)
                    for x in gather_kv(k_cache, v_cache, blocks, q.dtype, head_dim))
    valid = (torch.arange(padded)[None, :] < lens[:, None])[:, None, None, :]     # [R, 1, 1, L]
    token_ids = torch.tensor([starts[r] for r in rows], dtype=torch.long)
    queries = queries_for(q.index_select(0, token_ids), k_cache).view(num_rows, kv_heads, group, head_dim)
    # The CPU SDPA kernels keep the softmax and accumulators in fp32 for bf16 inputs.
    attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=valid, scale=scale)
    out.index_copy_(0, token_ids, attended.reshape(num_rows, q.shape[1], head_dim))


# A chunk after at least this many cached tokens attends them unmasked and itself causally, in two calls
# (_split_at_prefix): the one call over the whole context needs a mask that keeps SDPA on a slower path
# (512 bf16 tokens after 16,384: 84 -> 61 ms a layer; after 2,048 the two calls cost more).
SPLIT_PREFIX = 4096


def _prefill_row(out: Tensor, q: Tensor, k_cache: Tensor, v_cache: Tensor, start: int, n: int, n_ctx: int,
                 table: Tensor, scale: float, gather: Callable = gather_kv) -> None:
    """Row `start .. start + n` of q attended through SDPA; `gather` is gather_kv or a kernel of it."""
    block_size = k_cache.shape[1]
    blocks = table[: (n_ctx + block_size - 1) // block_size].long()
    # the gathered copy of a narrower or quantized cache is widened to q's dtype for SDPA: [Hk, ctx, D]
    keys, values = (x.flatten(0, 1)[:n_ctx].transpose(0, 1)
                    for x in gather(k_cache, v_cache, blocks, q.dtype, q.shape[-1]))
    queries = queries_for(q[start:start + n], k_cache).transpose(0, 1)             # [Hq, n, D]
    if n_ctx - n >= SPLIT_PREFIX and q.device.type == "cpu":
        out[start:start + n] = _split_at_prefix(queries, keys, values, n_ctx - n, scale).transpose(0, 1)
        return
    if n == n_ctx:
        mask, causal = None, True
    else:
        # Queries sit at the END of the context (after the cached prefix): bottom-right aligned causal mask.
        q_pos = torch.arange(n_ctx - n, n_ctx)
        mask, causal = torch.arange(n_ctx)[None, :] <= q_pos[:, None], False
    # A batch dimension of one: with 3-d inputs the CPU SDPA skips its flash kernel (512 causal tokens, 0.6B
    # heads: 44 -> 19 ms; 2,048: 750 -> 180 ms).
    attended = F.scaled_dot_product_attention(queries[None], keys[None], values[None], attn_mask=mask,
                                              is_causal=causal, scale=scale, enable_gqa=True)
    out[start:start + n] = attended[0].transpose(0, 1)


def _split_at_prefix(queries: Tensor, keys: Tensor, values: Tensor, prefix: int, scale: float) -> Tensor:
    """[Hq, n, D] attention of a chunk after `prefix` cached tokens as two flash calls merged by their
    log-sum-exps: the prefix unmasked, each kv head's GQA group of queries stacked as one head's rows, and
    the chunk's own keys causally (tokens see only the chunk's earlier ones)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu   # SDPA's CPU kernel, with the lse
    hq, n, d = queries.shape
    hk = keys.shape[0]
    old, lse_old = flash(queries.reshape(1, hk, hq // hk * n, d), keys[None, :, :prefix], values[None, :, :prefix],
                         scale=scale)[:2]
    new, lse_new = flash(queries[None], keys[:, prefix:].repeat_interleave(hq // hk, 0)[None],
                         values[:, prefix:].repeat_interleave(hq // hk, 0)[None], is_causal=True, scale=scale)[:2]
    lse_old, lse_new = lse_old.reshape(hq, n, 1), lse_new.reshape(hq, n, 1)
    top = torch.maximum(lse_old, lse_new)
    w_old, w_new = (lse_old - top).exp(), (lse_new - top).exp()
    return ((old.reshape(hq, n, d).float() * w_old + new[0].float() * w_new) / (w_old + w_new)).to(queries.dtype)


@register("paged_attention", "cpu")
def torch_paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, query_start_loc: Tensor,
                          context_lens: Tensor, block_tables: Tensor, scale: float) -> Tensor:
    starts, ctx = query_start_loc.tolist(), context_lens.tolist()
    _check_lengths(starts, ctx, q.shape[0], block_tables.shape[1] * k_cache.shape[1])
    out = torch.zeros_like(q)   # padding tokens past query_start_loc[-1] stay zero
    decode = [i for i in range(len(ctx)) if starts[i + 1] - starts[i] == 1]
    if decode:
        _decode_rows(out, q, k_cache, v_cache, decode, starts, ctx, block_tables, scale)
    for i, n_ctx in enumerate(ctx):
        n = starts[i + 1] - starts[i]
        if n > 1:
            _prefill_row(out, q, k_cache, v_cache, starts[i], n, n_ctx, block_tables[i], scale)
    return out


@torch.library.custom_op(f"{NAMESPACE}::paged_attention", mutates_args=())
def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, query_start_loc: Tensor, context_lens: Tensor,
                    block_tables: Tensor, scale: float) -> Tensor:
    _check(q, k_cache, v_cache, query_start_loc, context_lens, block_tables)
    return impl("paged_attention", q.device)(q, k_cache, v_cache, query_start_loc, context_lens,
                                             block_tables, scale)


@paged_attention.register_fake
def _(q: Tensor, k_cache: Tensor, v_cache: Tensor, query_start_loc: Tensor, context_lens: Tensor,
      block_tables: Tensor, scale: float) -> Tensor:
    _check(q, k_cache, v_cache, query_start_loc, context_lens, block_tables)
    return torch.empty_like(q)
