"""The shared-memory arena: one file of exactly `capacity` bytes, mapped by the sidecar and its clients."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
from pathlib import Path

from kvpool_sidecar.side_files import remove_if_same
from kvpool_sidecar.wire import ARENA_FILE, ARENA_HEADER, ARENA_HEADER_BYTES, ARENA_MAGIC, map_populated

log = logging.getLogger(__name__)


def file_mode(directory: Path, shared_group: bool) -> int:
    """The mode of the arena and the control socket in `directory`.

    Group-only (0660) where the files get a group every user of the arena has: this process's own
    when `shared_group` says so (the operator puts the sidecar's group in the pod's
    supplementalGroups), or the directory's when it has the set-group-ID bit (an emptyDir with a pod
    fsGroup). Otherwise this user's only (0600): whoever can write the arena or reach the socket can
    plant a chunk that vLLM loads, so vLLM must run as the same user or share a group."""
    return 0o660 if shared_group or directory.stat().st_mode & stat.S_ISGID else 0o600


def check_directory(directory: Path) -> None:
    """Refuses a directory that is a symlink or not a directory; warns when others can swap its files."""
    st = directory.lstat()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise OSError(f"--arena-dir {directory} must be a directory, not a symlink or a file")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        log.warning(
            "--arena-dir %s is writable by every user and not sticky: keep it private to the pod "
            "(an emptyDir mounted only by the sidecar and vLLM)",
            directory,
        )


def _open_own(path: Path, mode: int, size: int) -> tuple[int, bool]:
    """The arena file, opened without following a symlink; a file that is not this process's own
    regular, single-link file (planted before the sidecar started) is replaced, never used, and so
    is one of another size (another --capacity): shrunk in place, a client still copying through
    its mapping of the old size would touch pages past the end and die of SIGBUS. Replaced, the old
    file lives on while mapped, and clients map the new one when they see its epoch. Also returns
    whether the file is a previous run's arena of this size (its chunks may be adopted)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, mode)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        log.warning("replacing %s: a symlink", path)
    else:
        st = os.fstat(fd)
        own = stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1
        if own and st.st_size in (0, size):
            return fd, st.st_size == size
        os.close(fd)
        if own:
            log.warning("replacing %s: %d bytes, this arena is %d", path, st.st_size, size)
        else:
            why = f"not a regular file of this user (uid {st.st_uid}, {st.st_nlink} links)"
            log.warning("replacing %s: %s", path, why)
    path.unlink()
    return os.open(path, flags | os.O_EXCL, mode), False


class Arena:
    """A writable mapping of `<dir>/arena`. In a pod the dir is an emptyDir with medium Memory (tmpfs).

    The file is a header page (see wire.ARENA_HEADER) and `capacity` bytes of chunks after it."""

    def __init__(self, directory: Path, capacity: int, shared_group: bool = False) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        check_directory(directory)
        self.path = directory / ARENA_FILE
        self.mode = file_mode(directory, shared_group)
        self.capacity = capacity
        self.base = ARENA_HEADER_BYTES  # the first chunk byte
        self.size = size = ARENA_HEADER_BYTES + capacity
        self.epoch = secrets.randbits(63) + 1
        # The same file across sidecar restarts (an emptyDir outlives its containers): a client
        # that still maps it keeps a valid mapping, and memory is not held twice. Its old bytes are
        # trusted only where the journal names a chunk and its checksum still matches (store.py).
        fd, self.reused = _open_own(self.path, self.mode, size)
        self._inode = os.fstat(fd).st_ino
        try:
            os.fchmod(fd, self.mode)  # the umask may have narrowed it
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
        # A client still mapping this file from before a restart sees the new epoch at once, and so
        # refuses every offset it was handed by the old sidecar.
        ARENA_HEADER.pack_into(self.view, 0, ARENA_MAGIC, self.epoch)

    def header_intact(self) -> bool:
        """Whether the header still says what this sidecar wrote (16 bytes read: cheap per request)."""
        return ARENA_HEADER.unpack_from(self.view, 0) == (ARENA_MAGIC, self.epoch)

    def new_epoch(self) -> None:
        """Writes a header with a new epoch: every offset handed out before is refused by clients."""
        self.epoch = secrets.randbits(63) + 1
        ARENA_HEADER.pack_into(self.view, 0, ARENA_MAGIC, self.epoch)

    def remove(self) -> None:
        """Deletes the arena file, unless another sidecar has replaced it since. Clients that map it
        keep their mapping; its memory goes back when the last of them lets go."""
        remove_if_same(self.path, self._inode)

    def close(self) -> None:
        self.view.release()
        with contextlib.suppress(BufferError):  # a view is still exported; the OS unmaps at exit
            self._mmap.close()
