"""The shared-memory arena: one file of exactly `capacity` bytes, mapped by the sidecar and its clients."""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path

from kvpool_sidecar.wire import ARENA_FILE


def map_file(fd: int, size: int) -> mmap.mmap:
    """A shared writable mapping with its page tables filled at once (MAP_POPULATE where Linux has it)."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)


class Arena:
    """A writable mapping of `<dir>/arena`. In a pod the dir is an emptyDir with medium Memory (tmpfs)."""

    def __init__(self, directory: Path, size: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / ARENA_FILE
        self.size = size
        # A fresh file every start: whatever a previous process left there is not ours to trust.
        tmp = directory / (ARENA_FILE + ".new")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o660)
        try:
            os.ftruncate(fd, size)
            # Allocate every page now: a first touch during a save costs a page fault and zeroing
            # (measured: saves ran at a fifth of their speed), and a tmpfs too small for --capacity
            # fails here, at start, with a clear message instead of a SIGBUS mid-copy.
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                msg = f"cannot allocate the {size}-byte arena in {directory}: {e.strerror}"
                raise OSError(e.errno, msg) from e
            os.replace(tmp, self.path)
            self._mmap = map_file(fd, size)
        finally:
            os.close(fd)
        self.view = memoryview(self._mmap)

    def close(self) -> None:
        self.view.release()
        with contextlib.suppress(BufferError):  # a view is still exported; the OS unmaps at exit
            self._mmap.close()
