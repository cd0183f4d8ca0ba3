"""Promotions from the lower tier (Redis) into the arena, and what the store needs of that tier."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvpool_sidecar.arena import Arena
from kvpool_sidecar.chunk_index import ChunkIndex, Lease
from kvpool_sidecar.wire import checksum_pieces

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fetched:
    """A chunk read from a lower tier, to be promoted into the arena."""

    length: int
    checksum: int
    priority: int
    pieces: list[bytes] = field(repr=False)
    key: str | None = None  # the chunk's own key, when it was asked for by a block prefix's


class LowerTier(Protocol):
    """What the store needs from the Redis tier (None when there is none)."""

    def usable(self) -> bool: ...
    def saved(self, key: str, length: int, group: str | None) -> None: ...
    def loaded(self, keys: Sequence[str]) -> None: ...
    def deleted(self, key: str) -> None: ...
    def exists_many(self, keys: Sequence[str]) -> list[bool]: ...
    def fetch(self, key: str) -> Fetched | None: ...


class Promotions:
    """The store's promotions, under the store's lock and index: the bytes are copied outside the lock
    while the chunk's room is reserved."""

    def __init__(self, index: ChunkIndex, arena: Arena, lock: threading.RLock, lease_seconds: float):
        self.index = index
        self.arena = arena
        self.counters = index.counters
        self.lease_seconds = lease_seconds
        self._lock = lock
        self._promoting: dict[str, threading.Event] = {}  # key -> set when its promotion ends

    def promote_into(
        self, lower: LowerTier | None, keys: Sequence[str], lease: Lease, within: int | None = None
    ) -> None:
        """Loads chunks from the lower tier into the arena, pinned under the caller's lease, until the
        first that cannot be. within: only into free room (evicting nothing), and only a chunk of at
        most that many bytes."""
        if lower is None or not lower.usable():
            return
        for key in keys:
            if not self._promote(lower, key, lease, within):
                return

    def _promote(self, lower: LowerTier, key: str, lease: Lease, within: int | None) -> bool:
        """Pins `key` from the lower tier into the arena. A second promotion of the same key waits for
        the first and takes its result instead of failing."""
        while True:
            with self._lock:
                e = self.index.loadable(key) or self.index.entry(key)
                if e is not None and e.stored:  # someone promoted or saved it meanwhile
                    return self.index.pin_into(e, lease)
                running = self._promoting.get(key)
                if running is None:
                    if e is not None:  # being written by a client: not loadable yet
                        return False
                    done = self._promoting[key] = threading.Event()
                    break
            if not running.wait(self.lease_seconds):
                return False
        try:
            return self._promote_now(lower, key, lease, within)
        finally:
            with self._lock:
                del self._promoting[key]
            done.set()

    def _promote_now(self, lower: LowerTier, key: str, lease: Lease, within: int | None) -> bool:
        fetched = lower.fetch(key)
        if fetched is None or (within is not None and fetched.length > within):
            return False
        chunk = fetched.key or key  # reached through a block prefix: the chunk, found by it from now on
        # checked over the pieces we were given, never over the arena (which others map)
        if (
            sum(map(len, fetched.pieces)) != fetched.length
            or checksum_pieces(fetched.pieces) != fetched.checksum
        ):
            log.warning("chunk %s from the lower tier failed its checksum: not served, deleted", chunk)
            with self._lock:
                self.counters.corrupt_dropped += 1
            lower.deleted(chunk)  # what is left there is no use to anyone: the next save writes it anew
            return False
        with self._lock:
            if (held := self.index.stored(chunk)) is not None:  # the whole chunk came meanwhile
                return self.index.pin_into(held, lease)
            protect = {e.key for e in lease.entries}
            e = self.index.reserve_promotion(
                chunk,
                fetched.length,
                fetched.priority,
                protect,
                evict=within is None,
                prefixes=(key,) if chunk != key else (),
            )
            if e is None:
                return False
        pos = e.offset
        for piece in fetched.pieces:
            self.arena.view[pos : pos + len(piece)] = piece
            pos += len(piece)
        with self._lock:
            if e.dropped:  # the reservation expired meanwhile
                return False
            self.index.store(e, fetched.checksum)
            self.counters.promotions += 1
            return self.index.pin_into(e, lease)
