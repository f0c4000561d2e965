"""The host kernels' weights in 2 MiB pages (workers/backends/huge_pages.py): what the arena hands out is
aligned, disjoint and advised MADV_HUGEPAGE, and its memory goes back once no tensor holds it."""

from __future__ import annotations

import gc
import itertools
from pathlib import Path

import pytest
import torch
from support.memory_maps import mapping

from encoderd.workers.backends import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_tensors_are_aligned_disjoint_and_keep_their_values():
    arena = huge_pages.HugePageArena()
    sizes = [
        (1000, torch.bfloat16),
        (3, torch.int32),
        (5 << 20, torch.int8),
        (20 << 20, torch.bfloat16),
        (7, torch.int8),
    ]
    tensors = [arena.empty(count, dtype) for count, dtype in sizes]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    for i, ((count, dtype), t) in enumerate(zip(sizes, tensors, strict=True)):
        assert t.shape == (count,) and t.dtype == dtype and t.data_ptr() % huge_pages.ALIGN == 0
        assert not t.any()  # fresh anonymous memory
        t.fill_(i + 1)
    for i, t in enumerate(tensors):
        assert bool((t == i + 1).all())


@pytest.mark.skipif(not Path("/proc/self/smaps").exists() or not THP.exists(), reason="Linux without THP")
def test_blocks_are_whole_huge_pages_advised_for_them():
    arena = huge_pages.HugePageArena()
    small, large = arena.empty(1 << 10, torch.bfloat16), arena.empty(20 << 20, torch.int8)
    for tensor in (small, large):
        block = mapping(tensor.data_ptr())
        assert block is not None
        assert "hg" in block["flags"], block  # madvise(MADV_HUGEPAGE) took
        assert block["start"] % huge_pages.PAGE == 0 and block["end"] % huge_pages.PAGE == 0


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="no /proc/self/smaps")
def test_a_block_is_unmapped_once_no_tensor_holds_it():
    arena = huge_pages.HugePageArena()
    own_block = arena.empty(huge_pages.BLOCK, torch.uint8)  # over half a block: a block of its own
    view = own_block[100:200]
    address = own_block.data_ptr()
    held = mapping(address)
    del own_block
    gc.collect()
    assert mapping(address) == held  # the view still holds it
    del view
    gc.collect()
    gone = mapping(address)  # reading smaps allocates: its buffer may be mapped where the block was
    assert held is not None and (gone is None or gone != held)
