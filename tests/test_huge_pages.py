"""CPU memory in huge pages (engine/huge_pages.py): the arena's copies equal their tensors, packed one after
another on cache lines; a tensor larger than a region gets its own; CPU weights and the K/V pool lie in
mappings marked for transparent huge pages."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.huge_pages import ALIGN, HUGE_PAGE, HugePageArena
from engine.kv.pool import lazy_zeros
from engine.models.linear import LinearLoader, LinearParts
from ops.quant_weight import quantize_int4
from tiny_models import StoredWeights

CPU = torch.device("cpu")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()


def _vm_flags(ptr: int) -> list[str]:
    """The VmFlags of the mapping that holds address `ptr` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {ptr:#x}")


def test_arena_copies_are_packed_on_cache_lines():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=g), torch.randint(0, 256, (7,), generator=g, dtype=torch.uint8),
               torch.randn(0, 4).to(torch.bfloat16), torch.tensor(7, dtype=torch.int64),
               torch.randn(4, 6, generator=g).t()]                  # not contiguous: the copy is
    arena = HugePageArena()
    copies = [arena.place(t) for t in tensors]
    end = copies[0].data_ptr()
    for t, c in zip(tensors, copies):
        assert torch.equal(c, t) and c.dtype == t.dtype and c.shape == t.shape and c.is_contiguous()
        assert c.data_ptr() == end or not t.numel()   # right after the one before, on a cache line
        end += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    assert copies[0].data_ptr() % HUGE_PAGE == 0
    tensors[0].zero_()
    assert copies[0].any()               # copies, not views


def test_a_tensor_larger_than_a_region_gets_its_own():
    arena = HugePageArena(chunk=1 << 20)
    small = arena.place(torch.ones(1000, dtype=torch.uint8))
    big = arena.place(torch.arange(3 << 18, dtype=torch.float32))          # 3 MiB
    after = arena.place(torch.full((10,), 2.0))
    assert torch.equal(big, torch.arange(3 << 18, dtype=torch.float32)) and small.all() and (after == 2).all()
    assert big.data_ptr() % HUGE_PAGE == 0 and after.data_ptr() % HUGE_PAGE == 0
    assert len({small.data_ptr() // HUGE_PAGE, big.data_ptr() // HUGE_PAGE, after.data_ptr() // HUGE_PAGE}) == 3


@pytest.mark.parametrize("mode", ["auto", "none"])
def test_cpu_weights_and_the_pool_lie_in_huge_page_mappings(mode):
    g = torch.Generator().manual_seed(1)
    stored = quantize_int4(torch.randn(64, 256, generator=g))
    loader = LinearLoader(StoredWeights({"w": stored}), torch.float32, CPU, mode)
    weight = loader.load([("w", 64, 256)])
    tensors = [weight] if mode == "none" else [weight.qweight, weight.scales, weight.mins, weight.supers]
    if mode == "auto":
        assert not isinstance(weight, LinearParts) and torch.equal(weight.dequantize(), stored.dequantize())
    else:
        assert torch.equal(weight, stored.dequantize())
    for t in [*tensors, lazy_zeros((4, 16), torch.float32, CPU)]:
        assert ("hg" in _vm_flags(t.data_ptr())) == THP, "the mapping should be marked MADV_HUGEPAGE"
    assert "hg" not in _vm_flags(stored.qweight.data_ptr())      # the stored weight itself: torch's allocator
