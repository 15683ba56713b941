"""Prefix caching: which full K/V blocks hold which token prefix, the LRU of cached blocks nobody
holds, and (hybrid models) which recurrent-state checkpoints to keep. No torch.

A full block is named by a chained hash: hash(parent block's hash, its token ids), started from a
root that carries anything else that changes K/V (the salt). Equal hashes therefore mean equal
prefixes; a hit still re-checks the parent hash and the token ids so a collision can never serve
another prompt's K/V.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def root_hash(salt: bytes = b"") -> bytes:
    return _digest(b"pagedserve-prefix|" + salt)


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    return _digest(parent + array("q", tokens).tobytes())


class BlockChain:
    """The chained hashes of a token sequence's full blocks, extended as the sequence grows."""

    def __init__(self, block_size: int, root: bytes) -> None:
        self.block_size = block_size
        self.root = root
        self.hashes: list[bytes] = []

    def parent_of(self, index: int) -> bytes:
        return self.hashes[index - 1] if index else self.root

    def extend(self, tokens: Sequence[int], end: int | None = None) -> list[bytes]:
        """Hash the full blocks of `tokens[:end]` not hashed yet (tokens must extend what was hashed)."""
        bs = self.block_size
        for i in range(len(self.hashes), (len(tokens) if end is None else end) // bs):
            self.hashes.append(block_hash(self.parent_of(i), tokens[i * bs:(i + 1) * bs]))
        return self.hashes


@dataclass(frozen=True)
class Entry:
    """What names a cached block's content: its chained hash, its parent's and its token ids."""
    hash: bytes
    parent: bytes
    tokens: tuple[int, ...]


class PrefixCache:
    """hash -> block for full blocks whose K/V is written. Cached blocks that no request holds are
    "idle": they count as free, and the allocator evicts them least recently used first."""

    def __init__(self, block_size: int, salt: bytes = b"") -> None:
        self.block_size = block_size
        self.root = root_hash(salt)
        self._by_hash: dict[bytes, int] = {}
        self._entries: dict[int, Entry] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()     # least recently used first
        self.evictions = 0
        self.additions = 0      # blocks ever indexed: a changed count means a changed cache

    @property
    def num_cached(self) -> int:
        return len(self._entries)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def chain(self) -> BlockChain:
        return BlockChain(self.block_size, self.root)

    def __contains__(self, h: bytes) -> bool:
        return h in self._by_hash

    def is_cached(self, block: int) -> bool:
        return block in self._entries

    def is_idle(self, block: int) -> bool:
        return block in self._idle

    def lookup(self, tokens: Sequence[int], hashes: Sequence[bytes]) -> list[int]:
        """Blocks holding the longest cached run of `tokens`' first len(hashes) full blocks."""
        bs, found = self.block_size, []
        for i, h in enumerate(hashes):
            block = self._by_hash.get(h)
            if block is None:
                break
            entry = self._entries[block]
            parent = hashes[i - 1] if i else self.root
            if entry.parent != parent or entry.tokens != tuple(tokens[i * bs:(i + 1) * bs]):
                break
            found.append(block)
        return found

    def insert(self, block: int, chain: BlockChain, index: int, tokens: Sequence[int]) -> bool:
        """Index a block that now holds full block `index` of `tokens`. False (nothing changes) when
        that prefix is cached already in another block: the first copy stays the shared one."""
        bs = self.block_size
        return self.add(block, Entry(chain.hashes[index], chain.parent_of(index),
                                     tuple(tokens[index * bs:(index + 1) * bs])))

    def add(self, block: int, entry: Entry) -> bool:
        """Index `block` as holding `entry`'s prefix; False (nothing changes) when that prefix or the
        block is indexed already."""
        if entry.hash in self._by_hash or block in self._entries:
            return False
        self._by_hash[entry.hash] = block
        self._entries[block] = entry
        self.additions += 1
        return True

    def entries(self) -> list[tuple[int, Entry]]:
        """(block, entry) of every cached block, most recently used first: held blocks, then idle
        ones from the newest to the oldest."""
        held = [b for b in self._entries if b not in self._idle]
        return [(b, self._entries[b]) for b in held + list(reversed(self._idle))]

    def park(self, block: int) -> bool:
        """The last holder let go: a cached block becomes idle (most recently used); False for an
        uncached block, which goes back to the allocator's free heap."""
        if block not in self._entries:
            return False
        self._idle[block] = None
        return True

    def revive(self, block: int) -> None:
        """An idle block is held again (a hit)."""
        del self._idle[block]

    def evict(self) -> int:
        """Forget the least recently used idle block and hand it out for reuse."""
        block, _ = self._idle.popitem(last=False)
        del self._by_hash[self._entries.pop(block).hash]
        self.evictions += 1
        return block


class CheckpointCache:
    """Which recurrent-state checkpoints to keep (hybrid models): block hash -> the state slot holding
    the state right after that block, least recently used first. The slots themselves belong to the
    SlotAllocator (engine/kv/state_slots.py), which asks for the oldest checkpoint back when a slot is
    wanted and none is free."""

    def __init__(self) -> None:
        self._slots: OrderedDict[bytes, int] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, h: bytes) -> bool:
        return h in self._slots

    def latest(self, hashes: Sequence[bytes], max_blocks: int) -> int:
        """The most blocks j <= max_blocks whose state after block j-1 is checkpointed (0: none)."""
        for j in range(min(max_blocks, len(hashes)), 0, -1):
            if hashes[j - 1] in self._slots:
                return j
        return 0

    def use(self, h: bytes) -> int:
        """The slot of a checkpoint about to be restored; it becomes the most recently used."""
        self._slots.move_to_end(h)
        return self._slots[h]

    def add(self, h: bytes, slot: int) -> None:
        self._slots[h] = slot

    def pop(self, h: bytes) -> int:
        """Remove a checkpoint and give back its slot, state intact."""
        return self._slots.pop(h)

    def evict(self, keep: bytes | None = None) -> int | None:
        """Forget the least recently used checkpoint other than `keep`; its slot, or None if none."""
        for h in self._slots:
            if h != keep:
                self.evictions += 1
                return self._slots.pop(h)
        return None
