"""What an idle prefix-cache save costs (config `prefix_cache_save_interval_s`): a pool laid out as the
default model's (28 layers, K and V of [blocks, 16, 2, 128] bf16) with every block cached, written as
the engine's idle hook writes it. Prints the time on the engine's thread, the fsync on its own
thread, and how long a request that comes during the write waits for the save to give way.

    .venv/bin/python bench/prefix_snapshot.py                  # the default pool: 4,104 blocks
    .venv/bin/python bench/prefix_snapshot.py --blocks 1176    # Claude Code's first prompt
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.kv.allocator import BlockAllocator  # noqa: E402
from engine.kv.prefix_cache import PrefixCache  # noqa: E402
from engine.kv.snapshot import KVSnapshot  # noqa: E402


def cache_every_block(allocator: BlockAllocator, tokens: list[int]) -> None:
    """Every block of the pool cached, as one chain of `tokens` (a block's worth each), then idle."""
    cache, blocks = allocator.cache, allocator.num_free
    chain = cache.chain()
    chain.extend(tokens)
    handles = allocator.allocate(blocks)
    for i, h in enumerate(handles):
        cache.insert(h.block_id, chain, i, tokens)
    allocator.free(reversed(handles))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=4104, help="cached blocks (default: the default pool)")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--dir", default=None, help="where the file goes (default: a temporary directory)")
    args = p.parse_args()
    allocator = BlockAllocator(args.blocks, PrefixCache(16))
    tensors = [torch.randn(args.blocks, 16, 2, 128).bfloat16() for _ in range(2 * args.layers)]
    directory = args.dir or tempfile.mkdtemp(prefix="pagedserve-snapshot-")
    snapshot = KVSnapshot(directory, {"bench": 1}, allocator, tensors, interval_s=1e-9)
    # cached after the snapshot was made: it has changed, and a save is due at once
    cache_every_block(allocator, torch.randint(3, 30000, (args.blocks * 16,)).tolist())
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    waits = []
    for pieces in (1, 10, 30, 60, 100):         # a request comes after this many pieces
        asked, came = [0], [0.0]

        def busy() -> bool:
            asked[0] += 1
            came[0] = came[0] or (time.perf_counter() if asked[0] > pieces else 0.0)
            return asked[0] > pieces
        snapshot.save_when_idle(busy)           # put off: still changed and due
        waits.append((time.perf_counter() - came[0]) * 1e3)
    start = time.perf_counter()
    snapshot.save_when_idle(lambda: False)
    written = time.perf_counter()
    snapshot.wait()
    synced = time.perf_counter()
    print(f"{args.blocks} blocks, {nbytes / 1e9:.2f} GB: written on the engine's thread in {written - start:.2f} s, "
          f"synced and renamed on its own in {synced - written:.2f} s")
    print(f"a request during the write waited {min(waits):.1f}-{max(waits):.1f} ms "
          f"(median {statistics.median(waits):.1f}) for the save to give way")
    snapshot.path.unlink()


if __name__ == "__main__":
    main()
