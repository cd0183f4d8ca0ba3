"""Keeps the files the tests read again and again (vLLM's and torch's libraries, the control plane's
binaries) in the page cache while `make test` runs.

Why: CI machines like ours run DAMON with a `pageout` scheme that writes back every file page no process
has mapped once it sits idle for about a minute (`/sys/kernel/mm/damon/admin/kdamonds/*`). Every vLLM
engine a test starts then reads ~800 MB of libraries from disk again: on such a machine the test stage took
twice as long (3,475 s against 1,545-1,598 s). A page mapped by a live process is outside that scheme, so
this process maps, every few seconds, the pages of these files that are already in the page cache. It
reads nothing from disk itself, and kernel reclaim under memory pressure still takes mapped file pages.

    python tests/page_keeper.py DIR...     # until killed
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

SCAN_SECONDS = 20  # well under the minute a page must sit idle before DAMON pages it out
RELIST_SCANS = 15  # the file list is walked again every this many scans
MADV_POPULATE_READ = 22  # Linux 5.14: map pages into this process, reading only those not yet cached
MAX_MAPPINGS = 50_000  # under vm.max_map_count's default of 65,530

libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
libc.mmap.restype = ctypes.c_void_p
_ptr, _size, _int = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
libc.mmap.argtypes = [_ptr, _size, _int, _int, _int, ctypes.c_long]
libc.munmap.argtypes = [_ptr, _size]
libc.mincore.argtypes = [_ptr, _size, _ptr]
libc.madvise.argtypes = [_ptr, _size, _int]
MAP_FAILED = ctypes.c_void_p(-1).value
LOW_BIT = bytes(i & 1 for i in range(256))


@dataclass
class Mapping:
    addr: int
    size: int
    resident: int = 0  # pages cached at the last scan, all of them mapped here since


def loaded(name: str) -> bool:
    """Files a process maps or imports: shared libraries, byte code, executables (Python reads a
    module's .py only to compile it, once)."""
    return name.endswith(".pyc") or ".so" in name or "." not in name


def walk(roots: list[str]) -> list[str]:
    found = []
    for root in roots:
        for parent, _, names in os.walk(root):
            found += [
                p
                for n in names
                if loaded(n) and os.path.isfile(p := os.path.join(parent, n)) and not os.path.islink(p)
            ]
    return found


def map_file(path: str) -> Mapping | None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0) if size else MAP_FAILED
    finally:
        os.close(fd)
    return None if addr in (None, MAP_FAILED) else Mapping(addr, size)


def cached_runs(m: Mapping) -> tuple[int, Iterator[tuple[int, int]]]:
    """The number of the file's pages in the page cache, and their runs as (first page, end page)."""
    pages = (m.size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(m.addr, m.size, vec) != 0:
        return 0, iter(())
    cached = bytes(vec).translate(LOW_BIT)  # mincore's other bits are reserved

    def runs() -> Iterator[tuple[int, int]]:
        start = cached.find(1)
        while start >= 0:
            end = cached.find(0, start)
            end = pages if end < 0 else end
            yield start, end
            start = cached.find(1, end)

    return cached.count(1), runs()


def scan(paths: list[str], kept: dict[str, Mapping]) -> None:
    """Maps, in this process, every cached page of these files not mapped here yet."""
    for path in paths:
        m = kept.get(path) or map_file(path)
        if m is None:
            continue
        count, runs = cached_runs(m)
        if count == m.resident or (path not in kept and len(kept) >= MAX_MAPPINGS):
            if path not in kept:  # nothing of it cached: no mapping kept for it
                libc.munmap(m.addr, m.size)
            continue
        for start, end in runs:
            page = mmap.PAGESIZE
            libc.madvise(m.addr + start * page, (end - start) * page, MADV_POPULATE_READ)
        m.resident = count
        kept[path] = m


def main(roots: list[str]) -> None:
    kept: dict[str, Mapping] = {}
    paths: list[str] = []
    for n in range(sys.maxsize):
        if n % RELIST_SCANS == 0:
            paths = walk(roots)
        scan(paths, kept)
        time.sleep(SCAN_SECONDS)


if __name__ == "__main__":
    main(sys.argv[1:])
