"""What both sides of the sidecar's control channel agree on: keys, the checksum, slots, frames.

Standard library and xxhash only: the client (inside vLLM) imports this module, the server too,
so every value crossing the boundary is computed or checked by one function.
"""

from __future__ import annotations

import json
import mmap
import re
import struct
from dataclasses import dataclass
from typing import Any

import xxhash

KEY_PATTERN = "^[0-9a-f]{32,128}$"
_KEY_RE = re.compile(KEY_PATTERN)

ARENA_FILE = "arena"
CONTROL_SOCKET = "control.sock"

# Control operations, the same names over HTTP (POST /v1/arena/<op>, lookup at POST /v1/lookup) and
# over the Unix socket.
CONTROL_OPS = ("lookup", "reserve", "commit", "abort", "pin", "verify", "release")

# A Unix-socket frame: 4-byte big-endian length, then that many bytes of UTF-8 JSON.
FRAME_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 16 * 1024 * 1024


def is_key(key: object) -> bool:
    return isinstance(key, str) and _KEY_RE.match(key) is not None


def checksum(buf: Any) -> int:
    """The one checksum both sides use: xxh3_64 of the bytes (anything with the buffer protocol)."""
    return xxhash.xxh3_64_intdigest(buf)


@dataclass(frozen=True)
class Slot:
    """A place in the arena; a pinned chunk's slot also carries the checksum it was saved with."""

    key: str
    offset: int
    length: int
    checksum: int | None = None


@dataclass(frozen=True)
class Pinned:
    lease: str  # give back with release(); expires by itself after --lease-seconds
    slots: list[Slot]  # the longest loadable prefix of the keys asked for, with their checksums


def slot_to_json(slot: Slot) -> dict[str, Any]:
    return {"key": slot.key, "offset": slot.offset, "length": slot.length}


def slot_from_json(obj: dict[str, Any]) -> Slot:
    digest = obj.get("checksum")
    return Slot(obj["key"], int(obj["offset"]), int(obj["length"]), None if digest is None else int(digest))


def encode_frame(obj: Any) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    return FRAME_HEADER.pack(len(body)) + body


def map_populated(fd: int, size: int) -> mmap.mmap:
    """A shared writable mapping with its page tables filled at once (MAP_POPULATE).

    Both the sidecar (HTTP bodies, promotions, checksum reads) and its clients copy through the
    arena; a fault per 4 KiB page held copies at ~0.5 GB/s. Filling the tables up front costs
    0.1-0.5 s per GiB on the 2-core dev VM (more when it is busy), once.
    """
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
