"""First-fit allocator of byte extents over [0, capacity), with coalescing of free neighbours."""

from __future__ import annotations

import bisect

ALIGN = 64  # cache-line aligned starts keep copies fast; lengths are counted unrounded in stats


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


class Allocator:
    """Not thread-safe by itself: the store calls it under its lock."""

    def __init__(self, capacity: int, base: int = 0) -> None:
        """Extents of [base, base + capacity)."""
        self.capacity = capacity
        self._starts: list[int] = [base] if capacity > 0 else []  # sorted free extent starts
        self._lengths: dict[int, int] = {base: capacity} if capacity > 0 else {}
        self.free_bytes = capacity

    def footprint(self, length: int) -> int:
        """Bytes an allocation of `length` takes (at least one unit, so empty chunks have a place)."""
        return _round_up(max(length, 1))

    def alloc(self, length: int) -> int | None:
        need = self.footprint(length)
        for start in self._starts:
            size = self._lengths[start]
            if size >= need:
                i = bisect.bisect_left(self._starts, start)
                del self._starts[i]
                del self._lengths[start]
                if size > need:
                    self._insert(start + need, size - need)
                self.free_bytes -= need
                return start
        return None

    def take(self, offset: int, length: int) -> bool:
        """Allocates the extent at `offset` itself (a chunk adopted where it lies); False when any of
        it is not free."""
        need = self.footprint(length)
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0 or offset % ALIGN:
            return False
        start = self._starts[i]
        end = start + self._lengths[start]
        if offset + need > end:
            return False
        del self._starts[i]
        del self._lengths[start]
        if offset > start:
            self._insert(start, offset - start)
        if end > offset + need:
            self._insert(offset + need, end - offset - need)
        self.free_bytes -= need
        return True

    def free(self, offset: int, length: int) -> None:
        size = self.footprint(length)
        self.free_bytes += size
        i = bisect.bisect_left(self._starts, offset)
        # merge with the following extent
        if i < len(self._starts) and self._starts[i] == offset + size:
            size += self._lengths.pop(self._starts[i])
            del self._starts[i]
        # merge with the preceding extent
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._lengths[prev] == offset:
                self._lengths[prev] += size
                return
        self._starts.insert(i, offset)
        self._lengths[offset] = size

    def _insert(self, start: int, size: int) -> None:
        bisect.insort(self._starts, start)
        self._lengths[start] = size

    def largest_free(self) -> int:
        return max(self._lengths.values(), default=0)
