"""BlockAllocator: lowest-first, transactional failures, stale handles, private reservations; state slots
and the admission claim that takes blocks and a slot together."""
from __future__ import annotations

import pytest

from engine.contracts import StateOp
from engine.kv.allocator import BlockAllocator, OutOfBlocks, StaleHandleError
from engine.kv.prefix_cache import CheckpointCache
from engine.kv.resources import KVResources
from engine.kv.state_slots import StaleSlotError


def counts(a: BlockAllocator) -> tuple[int, int, int]:
    return a.num_free, a.num_reserved, a.num_used


def test_lowest_free_block_first():
    a = BlockAllocator(8)
    first = a.allocate(3)
    assert [h.block_id for h in first] == [0, 1, 2]
    a.free([first[1]])
    assert [h.block_id for h in a.allocate(2)] == [1, 3]   # the freed hole is refilled first


def test_failed_allocate_changes_nothing():
    a = BlockAllocator(6)
    a.allocate(2)
    with pytest.raises(OutOfBlocks, match="asked for 5 blocks; 4 of 6 are free"):
        a.allocate(5)
    assert counts(a) == (4, 0, 2)
    assert [h.block_id for h in a.allocate(4)] == [2, 3, 4, 5]


def test_exhaustion_and_refill():
    a = BlockAllocator(3)
    handles = a.allocate(3)
    assert counts(a) == (0, 0, 3)
    with pytest.raises(OutOfBlocks):
        a.allocate(1)
    with pytest.raises(OutOfBlocks):
        a.reserve(1)
    a.free(handles)
    assert counts(a) == (3, 0, 0)
    assert a.allocate(0) == []


def test_double_free_is_stale():
    a = BlockAllocator(4)
    h = a.allocate(1)[0]
    a.free([h])
    with pytest.raises(StaleHandleError):
        a.free([h])
    assert counts(a) == (4, 0, 0)


def test_old_handle_cannot_touch_a_reallocated_block():
    a = BlockAllocator(4)
    old = a.allocate(1)[0]
    a.free([old])
    new = a.allocate(1)[0]
    assert new.block_id == old.block_id and new != old
    with pytest.raises(StaleHandleError):
        a.check(old)
    with pytest.raises(StaleHandleError):
        a.free([old])
    assert a.check(new) == new.block_id and a.num_used == 1   # the new owner keeps it


def test_free_is_all_or_nothing():
    a = BlockAllocator(4)
    good = a.allocate(2)
    stale = a.allocate(1)[0]
    a.free([stale])
    with pytest.raises(StaleHandleError):
        a.free([good[0], stale])
    with pytest.raises(StaleHandleError):
        a.free([good[1], good[1]])
    assert a.num_used == 2
    a.free(good)
    assert counts(a) == (4, 0, 0)


def test_reserved_blocks_cannot_be_consumed_by_others():
    a = BlockAllocator(5)
    r = a.reserve(3)
    assert counts(a) == (2, 3, 0)
    with pytest.raises(OutOfBlocks):
        a.allocate(3)
    with pytest.raises(OutOfBlocks):
        a.reserve(3)
    others = a.allocate(2)
    assert counts(a) == (0, 3, 2)
    taken = [r.take(), r.take(), r.take()]    # the owner still gets all three
    assert sorted(h.block_id for h in taken + others) == [0, 1, 2, 3, 4]
    assert counts(a) == (0, 0, 5)
    with pytest.raises(OutOfBlocks, match="used up"):
        r.take()


def test_release_returns_untaken_blocks_only():
    a = BlockAllocator(4)
    r = a.reserve(3)
    h = r.take()
    assert r.remaining == 2 and counts(a) == (1, 2, 1)
    assert r.release() == 2
    assert counts(a) == (3, 0, 1)
    a.check(h)                                 # a taken block stays owned
    with pytest.raises(StaleHandleError):
        r.take()
    with pytest.raises(StaleHandleError):
        r.release()
    assert counts(a) == (3, 0, 1)


def test_failed_reserve_changes_nothing():
    a = BlockAllocator(4)
    a.reserve(2)
    with pytest.raises(OutOfBlocks, match="cannot reserve 3 blocks; 2 of 4 are free"):
        a.reserve(3)
    assert counts(a) == (2, 2, 0)


def test_invariant_under_mixed_use():
    a = BlockAllocator(10)
    r1, r2 = a.reserve(2), a.reserve(3)
    held = a.allocate(4) + [r1.take(), r2.take()]
    assert a.num_free + a.num_reserved + a.num_used == 10
    assert len({h.block_id for h in held}) == 6
    r1.release(), r2.release()
    a.free(held)
    assert counts(a) == (10, 0, 0)


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError):
        BlockAllocator(0)
    with pytest.raises(ValueError):
        BlockAllocator(2).allocate(-1)


# ---- state slots and the admission transaction ------------------------------------------------------

def test_claim_short_of_blocks_takes_no_slot():
    kv = KVResources(num_blocks=4, num_slots=2)
    assert kv.claim([], reserve=5) is None
    assert (kv.slots.num_used, kv.blocks.num_free, kv.blocks.num_reserved) == (0, 4, 0)
    claim = kv.claim([], reserve=4)
    assert claim.slot == 0 and claim.state_op == StateOp(0) and claim.reservation.remaining == 4


def test_claim_short_of_slots_takes_no_blocks():
    kv = KVResources(num_blocks=8, num_slots=1)
    assert kv.claim([], reserve=2) is not None
    assert kv.claim([], reserve=2) is None
    assert (kv.slots.num_used, kv.blocks.num_free) == (1, 6)


def test_checkpoints_count_as_free_and_a_restore_copies_or_adopts():
    checkpoints = CheckpointCache()
    kv = KVResources(num_blocks=8, num_slots=2, checkpoints=checkpoints)
    a, b = kv.slots.acquire(), kv.slots.acquire()
    kv.slots.keep_as(a, b"x")
    assert (kv.slots.num_used, kv.slots.num_free, len(checkpoints)) == (1, 1, 1)
    kv.slots.release(b)
    # a free slot is there: the restored checkpoint is copied into it and stays cached
    copy = kv.claim([], reserve=1, restore=b"x")
    assert copy.state_op == StateOp(b, a) and b"x" in checkpoints
    # no free slot but the checkpoint's own: the request resumes in it, nothing to copy
    kv.slots.release(copy.slot)
    kv.slots.acquire()
    adopt = kv.claim([], reserve=1, restore=b"x")
    assert (adopt.slot, adopt.state_op, len(checkpoints)) == (a, None, 0)


def test_released_slot_twice_is_stale():
    slots = KVResources(num_blocks=1, num_slots=1).slots
    slot = slots.acquire()
    slots.release(slot)
    with pytest.raises(StaleSlotError, match="released twice"):
        slots.release(slot)
    assert slots.num_free == 1
