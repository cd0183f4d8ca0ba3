"""Small files the sidecar keeps beside the arena (the write token, the engines' reports), written
whole or not at all, with the arena's mode."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


def write_atomically(path: Path, data: bytes, mode: int) -> int:
    """Writes `data` under a temporary name and renames it over `path`: a reader never sees half of
    it, and a symlink planted at the path is replaced, never followed. The new file's inode."""
    temp = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)  # the umask may have narrowed it
        write_all(fd, data)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()  # a full tmpfs keeps no half-written file
        raise
    finally:
        os.close(fd)
    return path.lstat().st_ino


def write_all(fd: int, data: bytes) -> None:
    """os.write until all of `data` is written (one call may write less)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def remove_if_same(path: Path, inode: int) -> None:
    """Deletes `path` unless another sidecar has replaced it since."""
    with contextlib.suppress(FileNotFoundError):
        if path.lstat().st_ino == inode:
            path.unlink()
