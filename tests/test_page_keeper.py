"""The page keeper maps what is cached of a file and leaves what is not: a mapped page is what keeps
DAMON's pageout off the libraries the tests read again and again (tests/page_keeper.py)."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import page_keeper


def mapped_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of the file (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isalnum() and "-" in line.split()[0]:
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def drop_from_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_cached_pages_are_mapped_and_an_uncached_file_is_not_kept(tmp_path: Path) -> None:
    lib = tmp_path / "libexample.so"
    lib.write_bytes(os.urandom(64 * mmap.PAGESIZE))
    drop_from_cache(lib)
    kept: dict[str, page_keeper.Mapping] = {}
    try:
        page_keeper.scan(page_keeper.walk([str(tmp_path)]), kept)
        assert kept == {} and mapped_kib(lib) == 0

        with lib.open("rb") as f:  # a process reads it, as an import does, and lets go of it
            f.read()
        page_keeper.scan(page_keeper.walk([str(tmp_path)]), kept)
        assert kept[str(lib)].resident == 64
        assert mapped_kib(lib) == 64 * mmap.PAGESIZE // 1024
    finally:
        for m in kept.values():
            page_keeper.libc.munmap(m.addr, m.size)
