"""The worker's KV cache moved onto a memfd that the save process maps (shared_kv.py): vLLM's tensor
keeps its bytes and its address, a window of zeros costs no copy, the save process's views see each
later write, a piece outside the whole pages is left to the reader, and a cache on transparent huge
pages is not moved onto the memfd's small ones."""

from __future__ import annotations

import os

import pytest
import torch
from workerkit import in_anonymous_memory

from kvpool_connector import shared_kv
from kvpool_connector.shared_kv import PAGE, SharedKV, share


def test_sharing_keeps_the_bytes_and_the_save_processs_views_see_later_writes(monkeypatch) -> None:
    monkeypatch.setattr(shared_kv, "WINDOW", 8 * PAGE)  # several windows: bytes in some, zeros in others
    backing = torch.zeros(64 * PAGE, dtype=torch.uint8)
    cache = backing[100 : 60 * PAGE]  # starts and ends inside a page, as an allocation may
    cache[: 20 * PAGE].random_(0, 256, generator=torch.Generator().manual_seed(0))
    before = cache.clone()
    region = share(cache.data_ptr(), cache.nbytes)
    assert region is not None
    first_page = -(-cache.data_ptr() // PAGE) * PAGE
    assert (region.address, region.length) == (
        first_page,
        (cache.data_ptr() + cache.nbytes) // PAGE * PAGE - first_page,
    )
    assert torch.equal(cache, before)
    shared = SharedKV((region,))  # takes and closes the fd, as in the save process
    with pytest.raises(OSError):
        os.fstat(region.fd)

    start = region.address - cache.data_ptr()
    cache[start + 3 * PAGE : start + 3 * PAGE + 1000] = 7  # the forward's writes after the move
    cache[start + 40 * PAGE : start + 41 * PAGE] = 9
    pieces = [(region.address + 3 * PAGE, 1000), (region.address + 40 * PAGE, PAGE)]
    views = shared.views(pieces)
    assert views is not None
    assert [v.tobytes() for v in views] == [b"\x07" * 1000, b"\x09" * PAGE]
    assert shared.views([(cache.data_ptr(), 10)]) is None  # the first partial page stays the worker's
    assert shared.views([*pieces, (region.address + region.length - 10, 20)]) is None  # past the end


def test_an_allocation_without_a_whole_page_is_not_shared() -> None:
    backing = torch.zeros(2 * PAGE, dtype=torch.uint8)
    start = -(-backing.data_ptr() // PAGE) * PAGE - backing.data_ptr()
    inside = backing[start + 1 : start + PAGE - 1]
    assert share(inside.data_ptr(), inside.nbytes) is None
    assert SharedKV(()).views([(inside.data_ptr(), 1)]) is None


def test_a_cache_on_huge_pages_stays_where_it_is_and_one_on_small_pages_moves() -> None:
    fill = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    huge, small = in_anonymous_memory(fill, huge=True), in_anonymous_memory(fill, huge=False)
    assert shared_kv.on_huge_pages(huge.data_ptr(), huge.nbytes), "the kernel gave no transparent huge page"
    before = huge.clone()
    assert share(huge.data_ptr(), huge.nbytes) is None  # the save process reads it through the kernel
    assert torch.equal(huge, before)
    assert shared_kv.on_huge_pages(huge.data_ptr(), huge.nbytes)

    assert not shared_kv.on_huge_pages(small.data_ptr(), small.nbytes)
    region = share(small.data_ptr(), small.nbytes)
    assert region is not None
    os.close(region.fd)
