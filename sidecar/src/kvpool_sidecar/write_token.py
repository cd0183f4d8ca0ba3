"""The write token: a new random value per sidecar start, in a file beside the arena with the
arena's mode, so only the users who may write the arena may write chunks over HTTP too."""

from __future__ import annotations

import hmac
import secrets
from pathlib import Path

from kvpool_sidecar.side_files import remove_if_same, write_atomically
from kvpool_sidecar.wire import WRITE_TOKEN_FILE


class WriteToken:
    def __init__(self, directory: Path, mode: int) -> None:
        self.path = directory / WRITE_TOKEN_FILE
        self.value = secrets.token_hex(32)
        self._inode = write_atomically(self.path, self.value.encode(), mode)

    def admits(self, given: str | None) -> bool:
        """Whether `given` is this token (compared in constant time)."""
        return given is not None and hmac.compare_digest(given.encode(), self.value.encode())

    def remove(self) -> None:
        remove_if_same(self.path, self._inode)
