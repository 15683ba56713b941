"""CPU memory in 2 MiB transparent huge pages, for the tensors a decode step streams through: the K/V pool
and the weights. With 4 KiB pages every page is a TLB miss and a boundary where the hardware prefetchers
stop; a step of the default model reads ~1.1 GB of weights, about 270,000 such pages. The kernel grants
huge pages where transparent huge pages are in `madvise` mode (asked for here) or `always`."""
from __future__ import annotations

import contextlib
import mmap

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64                  # a cache line: what torch's own CPU allocator gives a tensor


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """`nbytes` zero bytes (uint8) starting on a huge page. An anonymous mapping's pages come from the OS
    already zero and are committed only as they are first written."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):       # EINVAL: a kernel built without transparent huge pages
            region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)       # keeps the mapping alive
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start:start + nbytes]


class HugePageArena:
    """Contiguous copies of tensors, packed one after another into huge-page regions of `chunk` bytes (a
    larger tensor gets a region of its own). Pages are committed as they are written, so a region's unused
    tail costs address space, not memory."""

    def __init__(self, chunk: int = 256 << 20):
        self.chunk = chunk
        self._region = torch.empty(0, dtype=torch.uint8)
        self._used = 0

    def place(self, t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        if self._used + nbytes > self._region.numel():
            self._region, self._used = huge_page_bytes(max(self.chunk, nbytes)), 0
        out = self._region[self._used:self._used + nbytes].view(t.dtype).view(t.shape)
        self._used += -(-nbytes // ALIGN) * ALIGN
        return out.copy_(t)
