"""The K/V cache tensors, and how many blocks fit in the memory left after the weights."""
from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch


class PoolSizeError(RuntimeError):
    """The K/V pool cannot hold one full-length sequence; the message says what to change."""


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.kv_heads * self.head_dim * elem


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


def plan_num_blocks(shape: KVShape, *, kv_pool_tokens: int, max_concurrency: int,
                    max_model_len: int, device: torch.device, reserve_fraction: float = 0.1,
                    reserve_min_bytes: int = 1 << 30) -> int:
    """Blocks for the pool: the user's token count, else what free memory holds (minus a reserve),
    capped at max_concurrency full-length sequences; never less than one full-length sequence."""
    bs = shape.block_size
    per_seq = -(-max_model_len // bs) + 1          # a full-length sequence plus its spare block
    if kv_pool_tokens:
        blocks = -(-kv_pool_tokens // bs)
        source = f"kv_pool_tokens = {kv_pool_tokens:,}"
    else:
        free = available_bytes(device)
        usable = free - max(reserve_min_bytes, int(free * reserve_fraction))
        blocks = max(0, usable // shape.bytes_per_block)
        blocks = min(blocks, per_seq * max_concurrency)
        source = (f"{free / 2**30:.1f} GiB free memory ({shape.bytes_per_block:,} "
                  f"bytes per block of {bs} tokens)")
    if blocks < per_seq:
        raise PoolSizeError(
            f"the K/V pool ({blocks:,} blocks of {bs} tokens, from {source}) cannot hold one "
            f"sequence of max_model_len = {max_model_len:,} tokens ({per_seq:,} blocks); "
            f"lower max_model_len or raise kv_pool_tokens")
    return int(blocks)


class KVPool:
    """One (k, v) pair of `[num_blocks, block_size, kv_heads, head_dim]` tensors per attention layer."""

    def __init__(self, shape: KVShape, num_blocks: int, device: torch.device):
        self.shape = shape
        self.num_blocks = num_blocks
        dims = (num_blocks, shape.block_size, shape.kv_heads, shape.head_dim)
        # zeros, not empty: padded attention reads of unwritten slots must not meet NaN garbage
        self.layers = [(torch.zeros(dims, dtype=shape.dtype, device=device),
                        torch.zeros(dims, dtype=shape.dtype, device=device))
                       for _ in range(shape.num_layers)]

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.shape.bytes_per_block
