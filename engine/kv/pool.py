"""The K/V cache tensors, the recurrent-state slot tensors of hybrid models, and how many K/V blocks fit
in the memory left after the weights and the state slots."""
from __future__ import annotations

import math
from dataclasses import dataclass

import psutil
import torch

from engine.errors import UserError
from engine.huge_pages import huge_page_bytes
from ops import kv_quant


class PoolSizeError(UserError, RuntimeError):
    """The K/V pool cannot hold one full-length sequence; the message says what to change."""


class KVCacheDtypeError(UserError, ValueError):
    """An unknown kv_cache_dtype, or one the model's heads cannot be stored in; the message says the fix."""


# kv_cache_dtype names -> storage dtypes, or the name itself for the block-quantized formats (ops/kv_quant.py:
# uint8 rows, K Hadamard-rotated). "model" stores K/V in the activations' dtype; "auto" picks per device, see
# resolve_kv_cache_dtype.
KV_CACHE_DTYPE_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                        **{fmt: fmt for fmt in kv_quant.FORMATS}}
KV_CACHE_DTYPE_CHOICES = ("auto", "model", *KV_CACHE_DTYPE_NAMES)


def resolve_kv_cache_dtype(choice: str, device: torch.device, model_dtype: torch.dtype) -> torch.dtype | str:
    """The K/V storage dtype for `choice` (or the quantized format's name, "q8_0" / "q4_0"). `auto` on CPUs
    is bf16 whatever the activations' dtype: decode attention there is bound by the K/V it reads and widens
    them as it reads; bf16 widens with a shift and a mask where fp16 takes a dearer conversion instruction
    (and has less range), and bf16 K/V against bf16 queries use the CPU's bf16 dot products where it has
    them. On GPUs `auto` is the model's dtype."""
    if choice == "auto":
        return torch.bfloat16 if device.type == "cpu" else model_dtype
    if choice == "model":
        return model_dtype
    if choice not in KV_CACHE_DTYPE_NAMES:
        raise KVCacheDtypeError(f"kv_cache_dtype = {choice!r}: allowed are "
                                + ", ".join(f'"{c}"' for c in KV_CACHE_DTYPE_CHOICES))
    return KV_CACHE_DTYPE_NAMES[choice]


def check_kv_layout(dtype: torch.dtype | str, head_dim: int, block_size: int) -> None:
    """KVCacheDtypeError if a resolved K/V dtype cannot store heads of `head_dim` values in blocks of
    `block_size` slots (the builder calls it before the weights load, so a bad choice fails in a moment)."""
    if isinstance(dtype, str):
        problem = kv_quant.head_dim_problem(dtype, head_dim) or kv_quant.block_size_problem(dtype, block_size)
        if problem:
            raise KVCacheDtypeError(problem)


@dataclass(frozen=True)
class KVShape:
    """One attention layer's paged K/V, per layer and block; `dtype` is the storage dtype, which may be
    narrower than the activations' (the ops convert on write and read), or a quantized format's name
    (kv_quant.FORMATS: uint8 rows of row_bytes per slot and kv head, arranged in tiles); it sizes the pool."""
    num_layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype | str

    def __post_init__(self):
        check_kv_layout(self.dtype, self.head_dim, self.block_size)

    @property
    def slot_dims(self) -> tuple[int, int]:
        """(kv heads, values or bytes per head) of one cache slot."""
        if isinstance(self.dtype, str):
            return self.kv_heads, kv_quant.row_bytes(self.dtype, self.head_dim)
        return self.kv_heads, self.head_dim

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8 if isinstance(self.dtype, str) else self.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.storage_dtype).element_size()
        heads, per_head = self.slot_dims
        return 2 * self.num_layers * self.block_size * heads * per_head * elem


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


# A CPU pool is sized for what the configured concurrency needs: max_concurrency sequences of up to
# DEFAULT_CONTEXT tokens (fewer if max_model_len is shorter), in at most CPU_MEMORY_SHARE of the memory
# available after loading. A GPU pool takes what free memory allows: that is what a GPU server is for.
DEFAULT_CONTEXT = 8192
CPU_MEMORY_SHARE = 0.5


def plan_num_blocks(shape: KVShape, *, kv_pool_tokens: int, max_concurrency: int,
                    max_model_len: int, device: torch.device, reserve_fraction: float = 0.1,
                    reserve_min_bytes: int = 1 << 30, state_bytes: int = 0, draft: KVShape | None = None) -> int:
    """Blocks for the pool: the user's token count, else (CPU) what max_concurrency sequences of
    DEFAULT_CONTEXT tokens need, capped by CPU_MEMORY_SHARE of free memory, or (GPU) what free memory
    holds less a reserve, capped at max_concurrency full-length sequences. The `state_bytes` of
    recurrent-state slots come off the memory first; never less than one full-length sequence. A
    `draft` model's K/V (engine/draft.py) lives under the same block ids, so each block costs both."""
    bs = shape.block_size
    per_block = shape.bytes_per_block + (draft.bytes_per_block if draft else 0)
    per_seq = -(-max_model_len // bs) + 1          # a full-length sequence plus its spare block
    if kv_pool_tokens:
        blocks = -(-kv_pool_tokens // bs)
        source = f"kv_pool_tokens = {kv_pool_tokens:,}"
    else:
        free = available_bytes(device)
        if device.type == "cpu":
            usable = int(free * CPU_MEMORY_SHARE) - state_bytes
            wanted = max_concurrency * (-(-min(max_model_len, DEFAULT_CONTEXT) // bs) + 1)
            blocks = min(max(wanted, per_seq), max(0, usable // per_block))
        else:
            usable = free - max(reserve_min_bytes, int(free * reserve_fraction)) - state_bytes
            blocks = min(max(0, usable // per_block), per_seq * max_concurrency)
        source = (f"{free / 2**30:.1f} GiB free memory ({per_block:,} "
                  f"bytes per block of {bs} tokens)")
    if blocks < per_seq:
        raise PoolSizeError(
            f"the K/V pool ({blocks:,} blocks of {bs} tokens, from {source}) cannot hold one "
            f"sequence of max_model_len = {max_model_len:,} tokens ({per_seq:,} blocks); "
            f"lower max_model_len or raise kv_pool_tokens")
    return int(blocks)


def lazy_zeros(dims: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros whose CPU memory is only committed as it is first written (torch.zeros writes every byte at
    once), in huge pages (engine/huge_pages.py): decode attention reads blocks scattered over the whole
    pool, and with 4 KiB pages nearly every block is a TLB miss."""
    if device.type != "cpu":
        return torch.zeros(dims, dtype=dtype, device=device)
    nbytes = math.prod(dims) * torch.empty((), dtype=dtype).element_size()
    return huge_page_bytes(nbytes).view(dtype).view(dims)


class KVPool:
    """One (k, v) pair of `[num_blocks, block_size, kv_heads, head_dim]` tensors per attention layer."""

    def __init__(self, shape: KVShape, num_blocks: int, device: torch.device):
        self.shape = shape
        self.num_blocks = num_blocks
        dims = (num_blocks, shape.block_size, *shape.slot_dims)
        # zeros, not empty: padded attention reads of unwritten slots must not meet NaN garbage
        self.layers = [(lazy_zeros(dims, shape.storage_dtype, device), lazy_zeros(dims, shape.storage_dtype, device))
                       for _ in range(shape.num_layers)]

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.shape.bytes_per_block


@dataclass(frozen=True)
class StateShape:
    """Per linear-attention layer and slot: the conv inputs of the last K-1 tokens ([conv_dim, K-1], model
    dtype) and the Gated DeltaNet state ([v_heads, k_dim, v_dim], fp32: it accumulates over the whole
    sequence, so it is kept at full precision whatever the model dtype)."""
    num_layers: int
    conv_dim: int
    conv_width: int          # kernel size - 1
    v_heads: int
    k_dim: int
    v_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_slot(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_layer = self.conv_dim * self.conv_width * elem + self.v_heads * self.k_dim * self.v_dim * 4
        return self.num_layers * per_layer


def plan_num_state_slots(max_concurrency: int, spare_slots: int = 0) -> int:
    """One slot per running request, plus spares (prefix-cache checkpoints keep copies there)."""
    return max_concurrency + spare_slots


class StatePool:
    """One (conv, ssm) pair of `[num_slots, ...]` tensors per linear-attention layer. A slot belongs to
    one request (the scheduler assigns it); it is zeroed when assigned, and padding rows touch none."""

    def __init__(self, shape: StateShape, num_slots: int, device: torch.device):
        self.shape = shape
        self.num_slots = num_slots
        conv = (num_slots, shape.conv_dim, shape.conv_width)
        ssm = (num_slots, shape.v_heads, shape.k_dim, shape.v_dim)
        self.layers = [(torch.zeros(conv, dtype=shape.dtype, device=device),
                        torch.zeros(ssm, dtype=torch.float32, device=device))
                       for _ in range(shape.num_layers)]

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"state slot {slot} is outside 0..{self.num_slots - 1}")

    def reset(self, slot: int) -> None:
        self._check(slot)
        for conv, ssm in self.layers:
            conv[slot].zero_()
            ssm[slot].zero_()

    def copy(self, src: int, dst: int) -> None:
        self._check(src)
        self._check(dst)
        for conv, ssm in self.layers:
            conv[dst].copy_(conv[src])
            ssm[dst].copy_(ssm[src])

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.shape.bytes_per_slot
