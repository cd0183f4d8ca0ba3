"""The write token: a new random value per sidecar start, in a file beside the arena with the
arena's mode, so only the users who may write the arena may write chunks over HTTP too."""

from __future__ import annotations

import contextlib
import hmac
import os
import secrets
from pathlib import Path

from kvpool_sidecar.wire import WRITE_TOKEN_FILE


class WriteToken:
    def __init__(self, directory: Path, mode: int) -> None:
        self.path = directory / WRITE_TOKEN_FILE
        self.value = secrets.token_hex(32)
        # written under a temporary name and renamed over the old file: a reader never sees half a
        # token, and a symlink planted at the path is replaced, never followed
        temp = directory / f".{WRITE_TOKEN_FILE}.{secrets.token_hex(8)}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        try:
            os.fchmod(fd, mode)  # the umask may have narrowed it
            os.write(fd, self.value.encode())
        finally:
            os.close(fd)
        os.replace(temp, self.path)
        self._inode = self.path.lstat().st_ino

    def admits(self, given: str | None) -> bool:
        """Whether `given` is this token (compared in constant time)."""
        return given is not None and hmac.compare_digest(given.encode(), self.value.encode())

    def remove(self) -> None:
        """Deletes the file, unless another sidecar has replaced it since."""
        with contextlib.suppress(FileNotFoundError):
            if self.path.lstat().st_ino == self._inode:
                self.path.unlink()
