"""A request's engine resources side by side: K/V blocks (allocator.py) and, for hybrid models, one
recurrent-state slot (state_slots.py). Admission claims both in one transaction: everything, or when
either is short, nothing. No torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.contracts import StateOp
from engine.kv.allocator import BlockAllocator, BlockHandle, Reservation
from engine.kv.prefix_cache import CheckpointCache, PrefixCache
from engine.kv.state_slots import SlotAllocator


@dataclass(frozen=True)
class Claim:
    """What an admitted request holds: its cached prefix, the blocks set aside for the rest of its
    tokens, its state slot and the operation that readies the slot (reset, or copy a checkpoint in;
    None when the request resumes in the checkpoint's own slot or has no slot)."""
    shared: list[BlockHandle]
    reservation: Reservation
    slot: int | None
    state_op: StateOp | None


class KVResources:
    def __init__(self, num_blocks: int, num_slots: int, cache: PrefixCache | None = None,
                 checkpoints: CheckpointCache | None = None) -> None:
        self.blocks = BlockAllocator(num_blocks, cache)
        self.slots = SlotAllocator(num_slots, checkpoints)

    def claim(self, hit: list[int], reserve: int, restore: bytes | None = None) -> Claim | None:
        """Share the cached blocks `hit`, reserve `reserve` more and (hybrid) take a slot, resuming
        from checkpoint `restore` if given; None, with nothing taken, when blocks or slots are short."""
        blocks, slots = self.blocks, self.slots
        wants_slot = bool(slots.num_slots)
        if wants_slot and not slots.num_free:
            return None
        idle = 0 if blocks.cache is None else sum(blocks.cache.is_idle(b) for b in hit)
        if reserve + idle > blocks.num_free:
            return None
        shared = [blocks.share(b) for b in hit]
        reservation = blocks.reserve(reserve)
        slot, op = self._take_slot(restore) if wants_slot else (None, None)
        return Claim(shared, reservation, slot, op)

    def _take_slot(self, restore: bytes | None) -> tuple[int, StateOp | None]:
        slots = self.slots
        if restore is None:
            slot = slots.acquire()
            return slot, StateOp(slot)
        source = slots.checkpoints.use(restore)
        slot = slots.acquire(keep=restore)
        if slot is None:        # the checkpoint holds the only spare slot: resume in it
            return slots.adopt(restore), None
        return slot, StateOp(slot, source)
