"""Warm restarts (config `prefix_cache_dir`): the prefix cache's blocks, with their chained hashes,
token ids and K/V, are written to a file when the engine stops and read back when it starts, so the
prompts of the last run (an agent's long system prompt and tools) hit the cache at once instead of
being computed again.

A file holds one model's blocks in one K/V layout: its name is a digest of everything that decides
what a block holds (the weights file, dtype, quantization, the K/V shapes and dtype, the code that
computes and lays out K/V), so models and settings keep files of their own side by side. A draft model's K/V is not kept: the draft reads a
restored prefix like any cached one it has not read. Blocks come back as idle cached
blocks in their old order of use, which the allocator evicts like any other; when the pool is
smaller than the file, the most recently used blocks are kept, each with its whole chain of parents
(a block is found only after its parents). A file is also written while the engine is idle, at most
every `interval_s` and only when the cache gained blocks, so a crash loses at most that much of it.

Layout: MAGIC, the header's length (8 bytes, little endian), the JSON header, then n entries of
16-byte hash + 16-byte parent hash, n x block_size int64 token ids, and per pool tensor (header
order) the n blocks' bytes, most recently used first.
"""
from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.atomic_file import TEMP_SUFFIX, temp_path, temp_writer
from engine.kv.allocator import BlockAllocator
from engine.kv.prefix_cache import Entry

log = logging.getLogger("pagedserve.engine")
MAGIC = b"pagedserve-kv-1\n"
SAVE_CHUNK = 256            # blocks gathered per write: bounds the copy a save makes
HEADER_MAX = 1 << 20        # read at most this much of another file to find its fingerprint
CODE_KEYS = ("code", "torch")   # fingerprint keys that an upgrade changes for the same model and layout


class SnapshotError(ValueError):
    """A snapshot file that cannot be read back (torn, from another layout); the engine starts cold."""


class _PutOff(Exception):
    """An idle save stopped because a request came: the engine steps again, the save waits."""


# the code that decides what a K/V block holds: the model's forward up to write_kv, the kernels, the
# quantized formats' byte layout; a file written by other code is not read back (it could hold bytes in
# an older layout, which nothing could tell from the bytes themselves)
KV_CODE = ("ops", "engine/models", "engine/loading")


def code_identity(root: Path, dirs: tuple[str, ...] = KV_CODE) -> str:
    """A digest of the sources under `dirs` of the package tree at `root`."""
    digest = hashlib.blake2b(digest_size=16)
    for d in dirs:
        for f in sorted((root / d).rglob("*")):
            if f.suffix in (".py", ".cpp", ".h") and f.is_file():
                digest.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()


def weights_identity(path: str) -> list:
    """Name, size and modification time of a weights file, or of each file in a checkpoint dir."""
    p = Path(path)
    files = sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else [p]
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


class KVSnapshot:
    """Saves and restores one engine's prefix cache. `tensors` are the pool's block-indexed K/V
    tensors (every layer's k and v); `fingerprint` is what must match for a file to be read back
    (it also names the file); `interval_s`: how often at most an idle engine saves (0: only when
    it stops)."""

    def __init__(self, directory: str, fingerprint: dict, allocator: BlockAllocator,
                 tensors: list[torch.Tensor], interval_s: float = 0.0) -> None:
        self.fingerprint = fingerprint
        self.interval_s = interval_s
        digest = hashlib.blake2b(json.dumps(fingerprint, sort_keys=True).encode(), digest_size=8).hexdigest()
        self.path = Path(directory).expanduser() / f"{digest}.kv"
        self.allocator = allocator
        self.tensors = [t.view(torch.uint8).view(t.shape[0], -1) for t in tensors]   # a block = one row of bytes
        self._saved = (time.monotonic(), allocator.cache.additions)    # when, and the cache's count then
        self._syncing: threading.Thread | None = None                  # an idle save's fsync and rename
        self.restored = 0       # blocks read back at the start

    def _header(self, n: int) -> bytes:
        layout = [[t.shape[1]] for t in self.tensors]
        return json.dumps({"fingerprint": self.fingerprint, "blocks": n,
                           "block_size": self.allocator.cache.block_size, "layout": layout}).encode()

    @property
    def changed(self) -> bool:
        """The cache gained blocks since the file was last written or read."""
        return self.allocator.cache.additions != self._saved[1]

    def save(self) -> int:
        """Write every cached block; returns how many. Call it with the loop stopped (no step may
        write the pool meanwhile). The file is replaced whole or not at all; a failure to write is
        reported (the engine is stopping: there is nobody to raise to) and the old file stays."""
        self.wait()
        try:
            return self._commit(*self._write(lambda: False))
        except OSError as e:
            log.warning("prefix cache: not saved to %s (%s)", self.path, e)
            return 0

    def save_when_idle(self, busy: Callable[[], bool]) -> None:
        """The engine loop's idle hook (the loop thread, no step running): write the file if the
        cache changed and `interval_s` has passed since the last write. A request that comes
        meanwhile (`busy()`) stops the write between two pieces and the next idle moment starts it
        again; the fsync and rename run on a thread of their own, so the engine steps meanwhile."""
        if not self.interval_s or not self.changed or time.monotonic() < self._saved[0] + self.interval_s:
            return
        if self._syncing is not None and self._syncing.is_alive():
            return      # the last save is still syncing: a request should not wait for that
        try:
            written = self._write(busy)
        except _PutOff:
            return
        except Exception as e:      # whatever went wrong, the loop that called this must go on
            self._saved = (time.monotonic(), self._saved[1])    # tried again after the interval
            log.warning("prefix cache: not saved to %s (%s)", self.path, e)
            return
        self._syncing = threading.Thread(target=self._commit_logged, args=written, name="pagedserve-kv-save")
        self._syncing.start()

    def close(self) -> None:
        """The engine stops (its loop has stopped): save unless the file holds the cache already."""
        self.wait()
        if self.changed:
            self.save()

    def wait(self) -> None:
        """Wait for an idle save's fsync and rename to end."""
        if self._syncing is not None:
            self._syncing.join()
            self._syncing = None

    def _write(self, busy: Callable[[], bool]) -> tuple[Path, int, int, float]:
        """The file's bytes into a temporary file (not synced); returns it, the block count, the
        cache's addition count it holds and when it started."""
        started, additions = time.monotonic(), self.allocator.cache.additions
        entries = self.allocator.cache.entries()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_path(self.path)
        header = self._header(len(entries))
        header += b" " * (-(len(MAGIC) + 8 + len(header)) % 64)     # aligns the arrays after it
        try:
            with open(tmp, "xb") as f:
                f.write(MAGIC + len(header).to_bytes(8, "little") + header)
                f.write(b"".join(e.hash + e.parent for _, e in entries))
                f.write(torch.tensor([e.tokens for _, e in entries], dtype=torch.int64).numpy().tobytes())
                for t in self.tensors:
                    for i in range(0, len(entries), SAVE_CHUNK):
                        if busy():
                            raise _PutOff
                        ids = torch.tensor([b for b, _ in entries[i:i + SAVE_CHUNK]], device=t.device)
                        f.write(t.index_select(0, ids).cpu().numpy().data)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp, len(entries), additions, started

    def _commit(self, tmp: Path, n: int, additions: int, started: float) -> int:
        """Sync the written file and put it in place of the old one."""
        try:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._saved = (time.monotonic(), additions)
        self._drop_superseded()
        log.info("prefix cache: saved %d blocks to %s in %.1f s", n, self.path, time.monotonic() - started)
        return n

    def _commit_logged(self, *written) -> None:
        try:
            self._commit(*written)
        except Exception as e:
            self._saved = (time.monotonic(), self._saved[1])
            log.warning("prefix cache: not saved to %s (%s)", self.path, e)

    def _drop_superseded(self) -> None:
        """Delete this model's files that other code or another torch wrote (an upgrade left them):
        they can never be read back, and each is as large as the cache; and the temporary files of
        this file's saves that a killed process left."""
        mine = {k: v for k, v in self.fingerprint.items() if k not in CODE_KEYS}
        for other in self.path.parent.glob("*.kv"):
            if other == self.path:
                continue
            try:
                with open(other, "rb") as f:
                    theirs = read_header(f.read(len(MAGIC) + 8) + f.read(HEADER_MAX))[0].get("fingerprint")
            except (OSError, SnapshotError):
                continue
            if isinstance(theirs, dict) and {k: v for k, v in theirs.items() if k not in CODE_KEYS} == mine:
                other.unlink(missing_ok=True)
                log.info("prefix cache: removed %s, written by other code for this model", other)
        for tmp in self.path.parent.glob(f".{self.path.name}.*{TEMP_SUFFIX}"):
            if not _running(temp_writer(tmp)):
                tmp.unlink(missing_ok=True)

    def load(self) -> int:
        """Read the file back into free blocks, if there is one for this fingerprint; returns how
        many blocks were restored. A file that cannot be read is reported and left for the next save
        to replace: the engine starts cold."""
        if not self.path.exists():
            return 0
        started = time.monotonic()
        try:
            with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
                n = self._restore(mm)
        except (OSError, SnapshotError) as e:
            log.warning("prefix cache: %s not restored (%s); starting with an empty cache", self.path, e)
            return 0
        self._saved, self.restored = (time.monotonic(), self.allocator.cache.additions), n
        log.info("prefix cache: restored %d blocks from %s in %.1f s", n, self.path, time.monotonic() - started)
        return n

    def _restore(self, mm: mmap.mmap) -> int:
        header, end = read_header(mm)
        try:
            n, bs = int(header["blocks"]), int(header["block_size"])
        except (KeyError, TypeError, ValueError) as e:
            raise SnapshotError(f"unreadable header: {e}") from None
        expected = json.loads(self._header(n))
        if header != expected:
            raise SnapshotError("written for another model or K/V layout")
        sizes = [32 * n, 8 * bs * n] + [n * t.shape[1] for t in self.tensors]
        if len(mm) != end + sum(sizes):
            raise SnapshotError(f"{len(mm):,} bytes where the header promises {end + sum(sizes):,} (torn write?)")
        if n == 0:
            return 0
        names = mm[end:end + 32 * n]
        tokens = torch.frombuffer(mm, dtype=torch.int64, count=bs * n, offset=end + sizes[0]).view(n, bs).tolist()
        entries = [Entry(names[32 * i:32 * i + 16], names[32 * i + 16:32 * i + 32], tuple(tokens[i]))
                   for i in range(n)]
        keep = closed_prefix(entries, self.allocator.cache.root, self.allocator.num_free)
        # oldest first, so the blocks go idle in their old order of use
        blocks = self.allocator.adopt([entries[i] for i in reversed(keep)])[::-1]
        src, dst = torch.tensor(keep, dtype=torch.int64), torch.tensor(blocks, dtype=torch.int64)
        offset = end + sizes[0] + sizes[1]
        for t in self.tensors:
            saved = torch.frombuffer(mm, dtype=torch.uint8, count=n * t.shape[1], offset=offset).view(n, -1)
            t.index_copy_(0, dst.to(t.device), saved.index_select(0, src).to(t.device))
            offset += n * t.shape[1]
        return len(blocks)


def _running(pid: int | None) -> bool:
    if pid is None:
        return True         # not a name temp_path gives: not ours to delete
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass                # another user's process
    return True


def read_header(buf) -> tuple[dict, int]:
    """The JSON header at the start of a file's bytes (mapped or read) and where the arrays begin."""
    if buf[:len(MAGIC)] != MAGIC:
        raise SnapshotError("not a pagedserve prefix-cache file")
    at = len(MAGIC) + 8
    end = at + int.from_bytes(buf[len(MAGIC):at], "little")
    try:
        header = json.loads(buf[at:end])
    except ValueError as e:
        raise SnapshotError(f"unreadable header: {e}") from None
    if not isinstance(header, dict):
        raise SnapshotError("unreadable header: not an object")
    return header, end


def closed_prefix(entries: list[Entry], root: bytes, budget: int) -> list[int]:
    """Indices of at most `budget` entries (most recently used first) to keep: taken in order, each
    with the parents it needs before it, and none whose chain does not reach `root` in the file."""
    index = {e.hash: i for i, e in enumerate(entries)}
    kept: dict[int, None] = {}
    for i in range(len(entries)):
        chain, j = [], i
        while j not in kept:
            chain.append(j)
            parent = entries[j].parent
            if parent == root:
                break
            j = index.get(parent)
            # an orphan (its parent was evicted before the save), or a cycle only a corrupt file holds
            if j is None or len(chain) > len(entries):
                chain = []
                break
        if len(kept) + len(chain) > budget:
            break
        kept.update(dict.fromkeys(reversed(chain)))     # parents first
    return list(kept)
