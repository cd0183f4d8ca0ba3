"""The shared-memory arena: one file of exactly `capacity` bytes, mapped by the sidecar and its clients."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from kvpool_sidecar.wire import ARENA_FILE, map_populated


class Arena:
    """A writable mapping of `<dir>/arena`. In a pod the dir is an emptyDir with medium Memory (tmpfs)."""

    def __init__(self, directory: Path, size: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / ARENA_FILE
        self.size = size
        # The same file across sidecar restarts (an emptyDir outlives its containers): a client
        # that still maps it keeps a valid mapping, and memory is not held twice. Its old bytes are
        # never trusted: the index starts empty, and every chunk is checksummed before it is served.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            # Readable and writable by the vLLM container whatever user it runs as: the directory
            # is a volume private to the pod, so the pod's containers are all who can reach it.
            with contextlib.suppress(PermissionError):  # a file another user made keeps its mode
                os.fchmod(fd, 0o666)
            os.ftruncate(fd, size)
            # Allocate every page now: a first touch during a save costs a page fault and zeroing
            # (measured: saves ran at a fifth of their speed), and a tmpfs too small for --capacity
            # fails here, at start, with a clear message instead of a SIGBUS mid-copy.
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                msg = f"cannot allocate the {size}-byte arena in {directory}: {e.strerror}"
                raise OSError(e.errno, msg) from e
            self._mmap = map_populated(fd, size)
        finally:
            os.close(fd)
        self.view = memoryview(self._mmap)

    def close(self) -> None:
        self.view.release()
        with contextlib.suppress(BufferError):  # a view is still exported; the OS unmaps at exit
            self._mmap.close()
