"""Helpers of the sidecar tests: keys, payloads, saving and loading through the arena."""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from kvpool_sidecar.client import SidecarClient, Slot, checksum


def key(i: int, tag: str = "a") -> str:
    return hashlib.sha256(f"{tag}:{i}".encode()).hexdigest()


def payload(n: int, seed: int) -> bytes:
    """n bytes that differ between seeds everywhere, so a wrong chunk never passes for a right one."""
    block = hashlib.sha256(str(seed).encode()).digest() * 2048
    return (block * (n // len(block) + 1))[:n]


def reserved(c: SidecarClient, items: Sequence[tuple[str, int]], **kw: Any) -> list[Slot]:
    """c.reserve(items) where every reservation must be granted."""
    slots = c.reserve(items, **kw)
    assert all(s is not None for s in slots), f"reservations refused: {slots}"
    return [s for s in slots if s is not None]


def save(c: SidecarClient, chunks: dict[str, bytes], priority: int = 0) -> list[str]:
    """Saves through the arena; returns the keys that were written."""
    slots = c.reserve([(k, len(v)) for k, v in chunks.items()], priority)
    arena = c.arena()
    written = [s for s in slots if s is not None]
    for s in written:
        arena[s.offset : s.offset + s.length] = chunks[s.key]
    assert all(c.commit([(s, checksum(chunks[s.key])) for s in written]))
    return [s.key for s in written]


def load(c: SidecarClient, keys: list[str]) -> dict[str, bytes]:
    """Loads the longest loadable prefix through the arena."""
    pinned = c.pin(keys)
    arena = c.arena()
    try:
        return {s.key: bytes(arena[s.offset : s.offset + s.length]) for s in pinned.slots}
    finally:
        c.release(pinned.lease)


def http_json(url: str, method: str = "GET", body: bytes | None = None, headers: dict | None = None):
    """(status, parsed JSON or raw bytes) without raising on 4xx/5xx."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            status, data = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, data = e.code, e.read()
    try:
        return status, json.loads(data)
    except ValueError:
        return status, data


def redis_stats(c: SidecarClient) -> dict:
    return c.stats()["tiers"]["redis"]
