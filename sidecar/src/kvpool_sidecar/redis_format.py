"""How a chunk is laid out in Redis: its key, its meta (with the pool's MAC) and its pieces; and the
aliases that find a chunk by one of its block prefixes' keys."""

from __future__ import annotations

import hmac
import struct

PIECE_BYTES = 4 * 2**20  # Redis is slow with large values
META = struct.Struct(">4sQQiI16s")  # magic, length, checksum, priority, pieces, MAC
MAGIC = b"KVP3"
META_FIELD = "m"
_MAC_FIELDS = struct.Struct(">QQi")
_NO_MAC = bytes(16)
ALIAS_MAGIC = b"KVA1"


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


def alias_key(prefix: str) -> str:
    """The Redis string that names the chunk whose first blocks are the block prefix `prefix` keys."""
    return f"kvpool:v3:a:{prefix}"


def _alias_mac(pool_key: bytes | None, prefix: str, target: str) -> bytes:
    if pool_key is None:
        return _NO_MAC
    return hmac.digest(pool_key, b"kvpool-alias\0" + prefix.encode() + b"\0" + target.encode(), "sha256")[:16]


def alias_value(pool_key: bytes | None, prefix: str, target: str) -> bytes:
    """An alias's value: the target chunk's key under the pool's MAC of (prefix, target). Unsigned, a
    planted alias could make a prefix load another chunk's first blocks: wrong KV, checksum or not."""
    return ALIAS_MAGIC + _alias_mac(pool_key, prefix, target) + target.encode()


def alias_target(pool_key: bytes | None, prefix: str, value: bytes) -> str | None:
    """The chunk an alias value names, or None when it is not kvpool's or its MAC fails."""
    if len(value) <= 20 or value[:4] != ALIAS_MAGIC:
        return None
    try:
        target = value[20:].decode()
    except UnicodeDecodeError:
        return None
    return target if hmac.compare_digest(value[4:20], _alias_mac(pool_key, prefix, target)) else None
