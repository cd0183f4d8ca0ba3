"""The shared-memory arena: one file of exactly `capacity` bytes, mapped by the sidecar and its clients."""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path

from kvpool_sidecar.wire import ARENA_FILE


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
            os.replace(tmp, self.path)
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.view = memoryview(self._mmap)

    def close(self) -> None:
        self.view.release()
        with contextlib.suppress(BufferError):  # a view is still exported; the OS unmaps at exit
            self._mmap.close()
