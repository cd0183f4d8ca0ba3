"""The arena allocator: extents never overlap, stay inside the arena, and coalesce back to one."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_sidecar.allocator import Allocator

CAPACITY = 1 << 20


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, CAPACITY // 4)), max_size=120))
def test_extents_never_overlap_and_coalesce(ops: list[tuple[bool, int]]) -> None:
    a = Allocator(CAPACITY)
    live: dict[int, int] = {}
    for do_alloc, n in ops:
        if do_alloc or not live:
            off = a.alloc(n)
            if off is None:
                assert a.largest_free() < a.footprint(n)  # refused only when no free extent fits
                continue
            end = off + a.footprint(n)
            assert off >= 0 and end <= CAPACITY
            assert all(end <= o or o + a.footprint(m) <= off for o, m in live.items())
            live[off] = n
        else:
            off = next(iter(live))
            a.free(off, live.pop(off))
        assert a.free_bytes == CAPACITY - sum(a.footprint(m) for m in live.values())
    for off, n in list(live.items()):
        a.free(off, n)
    assert a.free_bytes == CAPACITY and a.largest_free() == CAPACITY


def test_a_chunk_larger_than_the_arena_is_refused() -> None:
    a = Allocator(4096)
    assert a.alloc(4097) is None
    assert a.alloc(4096) == 0 and a.alloc(1) is None
