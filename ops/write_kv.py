"""`pagedserve::write_kv`: scatter new K/V rows into the paged cache at their slots (block * BS + offset),
converted to the cache's storage dtype (rounded to nearest even, as `Tensor.to` does), or quantized into a
uint8 cache of q8_0 / q4_0 rows (ops/kv_quant.py; K rotated by the block Walsh-Hadamard transform first),
whose bytes go where the cache's tiles keep them."""
from __future__ import annotations

import torch
from torch import Tensor

from ops import kv_quant
from ops._registry import NAMESPACE, impl, register, require

# Storage dtypes of the paged K/V cache, independent of the activations' dtype: attention widens on read.
# A torch.uint8 cache holds block-quantized rows instead (kv_quant.FORMATS, told apart by their row bytes).
KV_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_cache_dtype(op: str, k_cache: Tensor, v_cache: Tensor, head_dim: int) -> str | None:
    """The caches' quantized format (None for a float cache) for heads of `head_dim` values."""
    allowed = ", ".join(str(d).removeprefix("torch.") for d in KV_CACHE_DTYPES)
    require(k_cache.dtype == v_cache.dtype and (k_cache.dtype in KV_CACHE_DTYPES or k_cache.dtype == torch.uint8),
            op, f"k_cache and v_cache must share one K/V storage dtype ({allowed}) or uint8 "
            f"({' / '.join(kv_quant.FORMATS)} rows), got {k_cache.dtype} and {v_cache.dtype}")
    if k_cache.dtype != torch.uint8:
        require(k_cache.shape[-1] == head_dim, op,
                f"the caches' last dim must be head_dim {head_dim}, got {k_cache.shape[-1]}")
        return None
    require(head_dim % kv_quant.BLOCK == 0, op,
            f"a quantized (uint8) cache needs head_dim a multiple of {kv_quant.BLOCK}, got {head_dim}")
    fmt = kv_quant.format_of(k_cache, head_dim)
    require(fmt is not None, op, "a uint8 cache must hold rows of " + " or ".join(
        f"{kv_quant.row_bytes(f, head_dim)} bytes ({f})" for f in kv_quant.FORMATS)
        + f" for head_dim {head_dim}, got {k_cache.shape[-1]}")
    problem = kv_quant.block_size_problem(fmt, k_cache.shape[1])
    require(problem is None, op, problem or "")
    require(k_cache.is_contiguous() and v_cache.is_contiguous(), op,
            f"a {fmt} cache must be contiguous: its blocks hold tiles of {kv_quant.TILE} slots of one kv head")
    return fmt


def _check(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    op = "write_kv"
    require(k_cache.dim() == 4 and v_cache.shape == k_cache.shape, op,
            f"k_cache and v_cache must both be [NB, BS, Hk, D or row bytes], got {tuple(k_cache.shape)} and "
            f"{tuple(v_cache.shape)}")
    require(k.dim() == 3 and k.shape == v.shape and k.shape[1] == k_cache.shape[2], op,
            f"k and v must be [T, Hk, D] with Hk={k_cache.shape[2]} from the cache, "
            f"got k {tuple(k.shape)}, v {tuple(v.shape)}")
    check_cache_dtype(op, k_cache, v_cache, k.shape[2])
    require(k.dtype == v.dtype and k.is_floating_point(), op,
            f"k and v must share a floating dtype, got k {k.dtype}, v {v.dtype}")
    require(slot_mapping.dtype == torch.int64 and slot_mapping.shape == (k.shape[0],), op,
            f"slot_mapping must be int64 [T={k.shape[0]}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")


def reference_write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Token by token; a quantized cache's blocks are turned into rows, written and arranged back."""
    block_size = k_cache.shape[1]
    fmt = kv_quant.format_of(k_cache, k.shape[-1])
    if fmt:
        k, v = kv_quant.quantize_kv(k, v, fmt)
        caches = [kv_quant.rows_of(k_cache, fmt, "k"), kv_quant.rows_of(v_cache, fmt, "v")]
    else:
        caches = [k_cache, v_cache]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        caches[0][slot // block_size, slot % block_size] = k[t]
        caches[1][slot // block_size, slot % block_size] = v[t]
    if fmt:
        k_cache.copy_(kv_quant.arrange(caches[0], fmt, "k"))
        v_cache.copy_(kv_quant.arrange(caches[1], fmt, "v"))


@register("write_kv", "cpu")
def torch_write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if slot_mapping.numel():
        hi = slot_mapping.max().item()
        require(hi < num_slots, "write_kv", f"slot {hi} is past the cache's last slot {num_slots - 1} "
                "(slot = block * block_size + offset; use -1 for padding tokens)")
    keep = (slot_mapping >= 0).nonzero().squeeze(1)
    slots = slot_mapping.index_select(0, keep)
    # (block, offset) indexing works for caches of any stride, unlike a flat view.
    blocks, offsets = slots // k_cache.shape[1], slots % k_cache.shape[1]
    k, v = k.index_select(0, keep), v.index_select(0, keep)
    fmt = kv_quant.format_of(k_cache, k.shape[-1])
    if fmt:
        k, v = kv_quant.quantize_kv(k, v, fmt)
        kv_quant.write_rows(k_cache, blocks, offsets, k, fmt, "k")
        kv_quant.write_rows(v_cache, blocks, offsets, v, fmt, "v")
        return
    k_cache.index_put_((blocks, offsets), k.to(k_cache.dtype))
    v_cache.index_put_((blocks, offsets), v.to(v_cache.dtype))


@torch.library.custom_op(f"{NAMESPACE}::write_kv", mutates_args=("k_cache", "v_cache"))
def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    _check(k_cache, v_cache, k, v, slot_mapping)
    impl("write_kv", k_cache.device)(k_cache, v_cache, k, v, slot_mapping)


@write_kv.register_fake
def _(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    _check(k_cache, v_cache, k, v, slot_mapping)
