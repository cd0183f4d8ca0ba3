"""What both sides of the sidecar's control channel agree on: keys, the checksum, slots, frames.

Standard library and xxhash only: the client (inside vLLM) imports this module, the server too,
so every value crossing the boundary is computed or checked by one function.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import xxhash

KEY_PATTERN = "^[0-9a-f]{32,128}$"

ARENA_FILE = "arena"
CONTROL_SOCKET = "control.sock"
# Beside the arena, with its mode: the token HTTP writes must carry (Authorization: Bearer <token>).
# The data API listens on loopback, which every user of a bare host can reach; the token makes HTTP
# writes need what mapping the arena needs: the files' user or group.
WRITE_TOKEN_FILE = "write-token"

# The arena file starts with a header page: magic, then the epoch of the sidecar that serves it (a
# random number per start). Every reserve and pin answer names its epoch; a client uses the offsets
# only when its own mapping shows the same epoch, so a restarted sidecar or a replaced file (whose
# inode number tmpfs may reuse) is always noticed. Chunks live after the header.
ARENA_HEADER = struct.Struct("<8sQ")
ARENA_MAGIC = b"KVPARENA"
ARENA_HEADER_BYTES = 4096

# A Unix-socket frame: 4-byte big-endian length, then that many bytes of UTF-8 JSON.
FRAME_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 16 * 1024 * 1024


def checksum(buf: Any) -> int:
    """The one checksum both sides use: xxh3_64 of the bytes (anything with the buffer protocol)."""
    return xxhash.xxh3_64_intdigest(buf)


def arena_epoch(view: Any) -> int | None:
    """The epoch in an arena mapping's header; None when the header is not a sidecar's."""
    magic, epoch = ARENA_HEADER.unpack_from(view, 0)
    return epoch if magic == ARENA_MAGIC else None


def checksum_pieces(pieces: Iterable[Any]) -> int:
    """checksum() of the concatenation of `pieces`, without concatenating them."""
    h = xxhash.xxh3_64()
    for piece in pieces:
        h.update(piece)
    return h.intdigest()


@dataclass(frozen=True)
class Slot:
    """A place in the arena, valid in the arena of `epoch` only.

    A reserved slot carries its reservation's generation, which commit must echo: a writer whose
    reservation expired, or that outlived the sidecar it reserved from, is refused. A pinned slot
    carries the checksum its chunk was saved with."""

    key: str
    offset: int
    length: int
    checksum: int | None = None
    gen: int = 0
    epoch: int = 0


@dataclass(frozen=True)
class Pinned:
    lease: str  # give back with release(); expires by itself after --lease-seconds
    slots: list[Slot]  # the longest loadable prefix of the keys asked for, with their checksums


def slot_to_json(slot: Slot) -> dict[str, Any]:
    return {"key": slot.key, "offset": slot.offset, "length": slot.length, "gen": slot.gen}


def slot_from_json(obj: dict[str, Any], epoch: int) -> Slot:
    digest = obj.get("checksum")
    return Slot(
        obj["key"],
        int(obj["offset"]),
        int(obj["length"]),
        None if digest is None else int(digest),
        int(obj.get("gen", 0)),
        epoch,
    )


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
