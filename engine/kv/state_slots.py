"""Who owns which recurrent-state slot (hybrid models). A slot holds one sequence's state of every
recurrent layer; it is a resource beside the K/V blocks (allocator.py): free (lowest first), held by
one request, or holding a prefix checkpoint. Which checkpoints to keep is the CheckpointCache's
decision (prefix_cache.py); a checkpoint's slot counts as free and is taken back, least recently used
first, when a slot is wanted and none is free. No torch: the state tensors live in engine/kv/pool.py.
"""
from __future__ import annotations

import heapq

from engine.kv.prefix_cache import CheckpointCache


class StaleSlotError(RuntimeError):
    """A slot is released or filed as a checkpoint while nobody holds it (double release)."""


class SlotAllocator:
    def __init__(self, num_slots: int, checkpoints: CheckpointCache | None = None) -> None:
        self.num_slots = num_slots
        self.checkpoints = checkpoints
        self._free = list(range(num_slots))     # sorted = a valid heap
        self._held: set[int] = set()

    @property
    def num_used(self) -> int:
        """Slots held by requests."""
        return len(self._held)

    @property
    def num_free(self) -> int:
        """Slots a request could take now: free ones plus checkpoints."""
        return self.num_slots - len(self._held)

    def acquire(self, keep: bytes | None = None) -> int | None:
        """A free slot, else the slot of the least recently used checkpoint other than `keep`; None
        when neither exists."""
        slot = heapq.heappop(self._free) if self._free else (
            self.checkpoints.evict(keep) if self.checkpoints is not None else None)
        if slot is not None:
            self._held.add(slot)
        return slot

    def adopt(self, h: bytes) -> int:
        """Take checkpoint `h`'s slot, state intact, for a request that resumes from it."""
        slot = self.checkpoints.pop(h)
        self._held.add(slot)
        return slot

    def release(self, slot: int) -> None:
        self._let_go(slot)
        heapq.heappush(self._free, slot)

    def keep_as(self, slot: int, h: bytes) -> None:
        """A held slot becomes checkpoint `h`: the cache keeps it until a slot is wanted."""
        self._let_go(slot)
        self.checkpoints.add(h, slot)

    def _let_go(self, slot: int) -> None:
        if slot not in self._held:
            raise StaleSlotError(f"state slot {slot} is not held by any request (released twice?)")
        self._held.remove(slot)
