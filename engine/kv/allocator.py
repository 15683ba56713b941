"""Who owns which K/V block: lowest free block first, transactional, generation-checked handles,
private reservations. No torch: the pool's tensors live in engine/kv/pool.py.

A block is "free" (anyone may allocate it), "reserved" (set aside for one Reservation, still in the
free heap but not allocatable by others) or "used" (held through a BlockHandle).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Iterable


class OutOfBlocks(RuntimeError):
    """Not enough free blocks; nothing was allocated or reserved."""


class StaleHandleError(RuntimeError):
    """A handle or reservation is used after its blocks were freed (double free, use after free)."""


@dataclass(frozen=True)
class BlockHandle:
    """Ownership of one block. `generation` changes each time the block is freed, so an old
    handle can never free or name a block that was re-allocated to someone else."""
    block_id: int
    generation: int


class Reservation:
    """Blocks set aside for one owner: nobody else can allocate them until taken or released."""

    def __init__(self, allocator: BlockAllocator, count: int) -> None:
        self._allocator = allocator
        self._remaining = count
        self._open = True

    @property
    def remaining(self) -> int:
        return self._remaining

    def take(self) -> BlockHandle:
        """Draw one reserved block (the lowest free one)."""
        if not self._open:
            raise StaleHandleError("reservation was already released; call reserve() again")
        if self._remaining == 0:
            raise OutOfBlocks("reservation is used up; allocate() from the free pool instead")
        self._remaining -= 1
        return self._allocator._take_reserved()

    def release(self) -> int:
        """Return the untaken blocks to the free pool; returns how many. Taken blocks stay owned."""
        if not self._open:
            raise StaleHandleError("reservation was already released")
        self._open = False
        returned, self._remaining = self._remaining, 0
        self._allocator._unreserve(returned)
        return returned


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self._heap = list(range(num_blocks))     # free and reserved block ids; sorted = a valid heap
        self._generation = [0] * num_blocks
        self._used = [False] * num_blocks
        self._reserved = 0

    @property
    def num_free(self) -> int:
        """Blocks anyone may allocate now (reserved ones excluded)."""
        return len(self._heap) - self._reserved

    @property
    def num_reserved(self) -> int:
        return self._reserved

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._heap)

    def allocate(self, n: int) -> list[BlockHandle]:
        """n blocks, lowest ids first; all or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise OutOfBlocks(f"asked for {n} blocks; {self.num_free} of {self.num_blocks} are free "
                              f"({self._reserved} reserved, {self.num_used} used)")
        return [self._pop() for _ in range(n)]

    def reserve(self, n: int) -> Reservation:
        """Set n free blocks aside for the caller; all or nothing."""
        if n < 0:
            raise ValueError(f"cannot reserve {n} blocks")
        if n > self.num_free:
            raise OutOfBlocks(f"cannot reserve {n} blocks; {self.num_free} of {self.num_blocks} are free "
                              f"({self._reserved} reserved, {self.num_used} used)")
        self._reserved += n
        return Reservation(self, n)

    def check(self, handle: BlockHandle) -> int:
        """The block id of a live handle; StaleHandleError if its block was freed since."""
        bid = handle.block_id
        if not (0 <= bid < self.num_blocks and self._used[bid]
                and self._generation[bid] == handle.generation):
            raise StaleHandleError(f"handle for block {bid} (generation {handle.generation}) is stale: "
                                   "the block was freed (and maybe re-allocated) since")
        return bid

    def free(self, handles: Iterable[BlockHandle]) -> None:
        """Return blocks to the pool; all or nothing (one stale or repeated handle frees none)."""
        handles = list(handles)
        ids = [self.check(h) for h in handles]
        if len(set(ids)) != len(ids):
            raise StaleHandleError(f"the same block is freed twice in one call: {sorted(ids)}")
        for bid in ids:
            self._used[bid] = False
            self._generation[bid] += 1
            heapq.heappush(self._heap, bid)

    def _pop(self) -> BlockHandle:
        bid = heapq.heappop(self._heap)
        self._used[bid] = True
        return BlockHandle(bid, self._generation[bid])

    def _take_reserved(self) -> BlockHandle:
        self._reserved -= 1
        return self._pop()

    def _unreserve(self, n: int) -> None:
        self._reserved -= n
