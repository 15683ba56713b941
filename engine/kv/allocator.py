"""Who owns which K/V block: lowest free block first, transactional, grant-checked handles,
private reservations, reference counts for blocks shared through the prefix cache. No torch: the
pool's tensors live in engine/kv/pool.py.

A block is "free" (anyone may allocate it), "reserved" (set aside for one Reservation, not
allocatable by others) or "used" (held through one or more BlockHandles). With a PrefixCache, a
cached block that nobody holds is "idle": free, reusable by a hit until it is evicted (least
recently used first, and only when no uncached free block is left).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Iterable

from engine.kv.prefix_cache import Entry, PrefixCache


class OutOfBlocks(RuntimeError):
    """Not enough free blocks; nothing was allocated or reserved."""


class StaleHandleError(RuntimeError):
    """A handle or reservation is used after its blocks were freed (double free, use after free)."""


@dataclass(frozen=True)
class BlockHandle:
    """One holder's share of one block. `generation` is unique to this grant, so a freed handle can
    never free or name the block again, even while other holders still share it."""
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
    def __init__(self, num_blocks: int, cache: PrefixCache | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self.cache = cache
        self._heap = list(range(num_blocks))     # free uncached block ids; sorted = a valid heap
        self._holders: list[set[int]] = [set() for _ in range(num_blocks)]   # live grant numbers
        self._grants = 0
        self._reserved = 0

    @property
    def num_free(self) -> int:
        """Blocks anyone may allocate now: uncached free plus idle cached, reserved ones excluded."""
        return len(self._heap) + self._idle() - self._reserved

    @property
    def num_reserved(self) -> int:
        return self._reserved

    @property
    def num_used(self) -> int:
        """Blocks held by at least one handle."""
        return self.num_blocks - len(self._heap) - self._idle()

    def refcount(self, block_id: int) -> int:
        return len(self._holders[block_id])

    def allocate(self, n: int) -> list[BlockHandle]:
        """n blocks, lowest uncached ids first, then evicted idle cached ones; all or nothing."""
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

    def share(self, block_id: int) -> BlockHandle:
        """Hold a cached block found by a prefix-cache lookup (used by others, or idle)."""
        if self.cache is None or not self.cache.is_cached(block_id):
            raise StaleHandleError(f"block {block_id} is not in the prefix cache; only cached blocks "
                                   "are shared (look it up again)")
        if self.cache.is_idle(block_id):
            if self.num_free < 1:
                raise OutOfBlocks(f"reviving idle block {block_id} needs a free block; "
                                  f"{self._reserved} of the free blocks are reserved")
            self.cache.revive(block_id)
        return self._grant(block_id)

    def adopt(self, entries: list[Entry]) -> list[int]:
        """Index uncached free blocks as holding `entries` (a saved cache read back, least recently
        used first); they become idle cached blocks in that order. Their ids, for the caller to fill
        with the entries' K/V. All or nothing."""
        if self.cache is None:
            raise ValueError("this allocator has no prefix cache to adopt blocks into")
        if len(entries) > len(self._heap) - self._reserved:
            raise OutOfBlocks(f"cannot adopt {len(entries)} cached blocks; {len(self._heap) - self._reserved} "
                              "uncached blocks are free")
        hashes = {e.hash for e in entries}
        if len(hashes) < len(entries) or any(h in self.cache for h in hashes):
            raise ValueError("adopted entries must be distinct and not cached yet")
        blocks = [heapq.heappop(self._heap) for _ in entries]
        for bid, entry in zip(blocks, entries):
            self.cache.add(bid, entry)
            self.cache.park(bid)
        return blocks

    def check(self, handle: BlockHandle) -> int:
        """The block id of a live handle; StaleHandleError if it was freed since."""
        bid = handle.block_id
        if not (0 <= bid < self.num_blocks and handle.generation in self._holders[bid]):
            raise StaleHandleError(f"handle for block {bid} (generation {handle.generation}) is stale: "
                                   "it was freed (and the block maybe re-allocated) since")
        return bid

    def free(self, handles: Iterable[BlockHandle]) -> None:
        """Let go of blocks; all or nothing (one stale or repeated handle frees none). A block whose
        last holder lets go returns to the free heap, or stays idle in the cache if cached."""
        handles = list(handles)
        ids = [self.check(h) for h in handles]
        if len(set(ids)) != len(ids):
            raise StaleHandleError(f"the same block is freed twice in one call: {sorted(ids)}")
        for h in handles:
            holders = self._holders[h.block_id]
            holders.remove(h.generation)
            if not holders and (self.cache is None or not self.cache.park(h.block_id)):
                heapq.heappush(self._heap, h.block_id)

    def _idle(self) -> int:
        return 0 if self.cache is None else self.cache.num_idle

    def _grant(self, bid: int) -> BlockHandle:
        self._grants += 1
        self._holders[bid].add(self._grants)
        return BlockHandle(bid, self._grants)

    def _pop(self) -> BlockHandle:
        bid = heapq.heappop(self._heap) if self._heap else self.cache.evict()
        return self._grant(bid)

    def _take_reserved(self) -> BlockHandle:
        self._reserved -= 1
        return self._pop()

    def _unreserve(self, n: int) -> None:
        self._reserved -= n
