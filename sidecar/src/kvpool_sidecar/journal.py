"""The arena's journal: which chunks the arena holds, so that a restarted sidecar adopts them again.

The arena file outlives the sidecar process (a pod's emptyDir, --keep-arena); the index in its
memory does not. Beside the arena the sidecar appends one record per chunk stored and one per chunk
dropped, each written before the store's lock is released. So the extent of a dropped chunk goes to
a new writer only after its drop is on file, and a kill -9 at any point leaves a journal that names
no chunk whose bytes may be another's. A restart replays it and adopts each chunk whose bytes still
match its checksum; torn, uncommitted and overwritten ones are not adopted.

The file is rewritten with the live records alone when it has doubled, and given up (deleted: a
restart then starts empty, as before the journal) past its byte budget or on a write error: the
journal never fails a request. Block-prefix keys are not kept: an adopted chunk is found by its own
key, and by its block prefixes again once it is saved again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvpool_sidecar.side_files import write_all, write_atomically

log = logging.getLogger(__name__)

JOURNAL_FILE = "arena.journal"
# kind, offset, length, checksum, priority, key length; then the key (ASCII hex), then a CRC-32 of both
RECORD = struct.Struct("<BQQQiH")
CRC = struct.Struct("<I")
STORED, DROPPED = 1, 2
MIN_COMPACT_BYTES = 64 * 1024  # below this a rewrite is not worth its copy


class Chunk(Protocol):
    """What a record says of a chunk (the index's entries have it, and so do records)."""

    @property
    def key(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def length(self) -> int: ...
    @property
    def checksum(self) -> int: ...
    @property
    def priority(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Record:
    key: str
    offset: int
    length: int
    checksum: int
    priority: int


def budget_bytes(capacity: int) -> int:
    """What the journal of an arena this big may take (tmpfs pages the pod's memory counts): at
    most two records per live chunk between rewrites, a record is about 100 bytes, and a chunk of
    vLLM's KV is tens of KiB at the least. The operator gives the emptyDir the same room."""
    return capacity // 256 + 2**20


def encode(kind: int, record: Chunk) -> bytes:
    raw = record.key.encode("ascii")
    body = RECORD.pack(kind, record.offset, record.length, record.checksum, record.priority, len(raw)) + raw
    return body + CRC.pack(zlib.crc32(body))


def replay(data: bytes) -> dict[str, Record]:
    """The chunks a journal says are held: stored and not dropped since. A record that does not check
    out ends the replay (the last one, torn by a kill mid-write): everything before it stands."""
    live: dict[str, Record] = {}
    pos = 0
    while pos + RECORD.size <= len(data):
        kind, offset, length, digest, priority, n = RECORD.unpack_from(data, pos)
        end = pos + RECORD.size + n
        if end + CRC.size > len(data) or CRC.unpack_from(data, end)[0] != zlib.crc32(data[pos:end]):
            break
        try:
            key = data[pos + RECORD.size : end].decode("ascii")
        except UnicodeDecodeError:
            break
        if kind == STORED:
            live[key] = Record(key, offset, length, digest, priority)
        elif kind == DROPPED:
            live.pop(key, None)
        else:
            break
        pos = end + CRC.size
    return live


class Journal:
    """Appends to `<arena dir>/arena.journal`. Not thread-safe: the index calls it under the store's lock."""

    def __init__(self, path: Path, budget: int) -> None:
        self.path = path
        self.budget = budget
        self._fd: int | None = None
        self._size = 0  # bytes in the file
        self._live = 0  # bytes of the records of chunks still held

    @property
    def on(self) -> bool:
        return self._fd is not None

    def read(self) -> dict[str, Record]:
        """What the last run's journal says is held; nothing when there is none or it is unreadable."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return {}
        try:
            if os.fstat(fd).st_size > self.budget:
                return {}  # not one this sidecar wrote (it never grows one past its budget)
            with os.fdopen(fd, "rb", closefd=False) as f:
                return replay(f.read())
        finally:
            os.close(fd)

    def rewrite(self, held: Iterable[Chunk]) -> None:
        """Starts the file afresh with the records of `held`; gives the journal up when they exceed
        the budget."""
        data = b"".join(encode(STORED, r) for r in held)
        if len(data) > self.budget:
            self.give_up(f"{len(data)} bytes of records exceed its budget of {self.budget}")
            return
        try:  # whole or not at all: a kill mid-rewrite leaves the old file
            write_atomically(self.path, data, 0o600)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            self.give_up(f"cannot write it: {e}")
            return
        self.close()
        self._fd, self._size, self._live = fd, len(data), len(data)

    def stored(self, chunk: Chunk) -> None:
        rec = encode(STORED, chunk)
        self._live += len(rec)
        self._append(rec)

    def dropped(self, chunk: Chunk) -> None:
        rec = encode(DROPPED, chunk)
        self._live -= len(rec)  # its stored record's size: the same fields
        self._append(rec)

    def due(self) -> bool:
        """Whether the file has grown to twice its live records: time to rewrite it."""
        return self.on and self._size > max(2 * self._live, MIN_COMPACT_BYTES)

    def _append(self, rec: bytes) -> None:
        if self._fd is None:
            return
        if self._size + len(rec) > self.budget:
            self.give_up(f"it would pass its budget of {self.budget} bytes")
            return
        try:
            write_all(self._fd, rec)
        except OSError as e:
            self.give_up(f"cannot append to it: {e}")
            return
        self._size += len(rec)

    def give_up(self, why: str) -> None:
        """Stops journaling and deletes the file: a restart then adopts nothing, never a stale chunk."""
        log.warning("arena journal %s off: %s; a restarted sidecar starts empty", self.path, why)
        self.close()
        self.remove()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
