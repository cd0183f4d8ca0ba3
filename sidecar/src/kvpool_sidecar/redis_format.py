"""How a chunk is laid out in Redis: its key, its meta (with the pool's MAC) and its pieces."""

from __future__ import annotations

import hmac
import struct

PIECE_BYTES = 4 * 2**20  # Redis is slow with large values
META = struct.Struct(">4sQQiI16s")  # magic, length, checksum, priority, pieces, MAC
MAGIC = b"KVP3"
META_FIELD = "m"
_MAC_FIELDS = struct.Struct(">QQi")
_NO_MAC = bytes(16)


def chunk_key(key: str) -> str:
    """The Redis hash of one chunk: field "m" its meta, fields "0".."n-1" its pieces."""
    return f"kvpool:v3:{key}"


def chunk_mac(pool_key: bytes | None, key: str, length: int, digest: int, priority: int) -> bytes:
    """The pool's MAC of a chunk's meta (zeros without a key)."""
    if pool_key is None:
        return _NO_MAC
    message = b"kvpool-chunk\0" + key.encode() + _MAC_FIELDS.pack(length, digest, priority)
    return hmac.digest(pool_key, message, "sha256")[:16]


def piece_count(length: int) -> int:
    return max(1, -(-length // PIECE_BYTES))
