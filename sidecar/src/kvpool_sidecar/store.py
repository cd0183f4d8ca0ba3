"""The chunk store: the CPU tier's index over the arena, leases, eviction, and the hooks to Redis.

One object, thread-safe, used by the asyncio handlers and by the Redis tier's threads. The index
is changed under one lock; big copies and checksums run outside it while the chunk is reserved or
pinned, which is also what keeps a chunk from being evicted or overwritten while it is in use.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from kvpool_sidecar.allocator import Allocator
from kvpool_sidecar.arena import Arena
from kvpool_sidecar.wire import Slot, checksum, checksum_pieces

log = logging.getLogger(__name__)
_SLICE = 256  # batch items handled under one hold of the lock


class PutResult(Enum):
    CREATED = "created"
    EXISTS = "exists"
    FULL = "full"  # no room even after eviction
    BUSY = "busy"  # another client is writing this key right now
    EXPIRED = "expired"  # the reservation expired while the body was written: nothing stored


@dataclass(eq=False, slots=True)  # slots: half a million entries must fit the sidecar's allowance
class Entry:
    key: str
    offset: int
    length: int
    priority: int
    stored: bool = False  # False while reserved (being written)
    checksum: int = 0
    last_use: int = 0
    pins: int = 0
    deadline: float = 0.0  # a reservation's expiry
    dropped: bool = False  # out of the index; its extent is freed when the last pin goes
    gen: int = 0  # the reservation's generation: a commit must echo it
    group: str | None = None  # the chunk this is one rank's copy of


@dataclass(eq=False)
class Lease:
    entries: list[Entry]
    deadline: float
    expired: bool = False  # set by the reaper or release(), which has then unpinned `entries`


@dataclass
class Counters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    corrupt_dropped: int = 0
    reservations_expired: int = 0
    leases_expired: int = 0
    promotions: int = 0
    refused_commits: int = 0  # commits of a reservation that was no longer the writer's


@dataclass(frozen=True)
class Fetched:
    """A chunk read from a lower tier, to be promoted into the arena."""

    length: int
    checksum: int
    priority: int
    pieces: list[bytes] = field(repr=False)


class LowerTier(Protocol):
    """What the store needs from the Redis tier (None when there is none)."""

    def usable(self) -> bool: ...
    def saved(self, key: str, length: int, group: str | None) -> None: ...
    def deleted(self, key: str) -> None: ...
    def exists_many(self, keys: Sequence[str]) -> list[bool]: ...
    def fetch(self, key: str) -> Fetched | None: ...


class Store:
    def __init__(
        self,
        arena: Arena,
        *,
        lease_seconds: float = 30.0,
        max_chunks: int = 200_000,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.arena = arena
        self.capacity = arena.capacity
        self.lease_seconds = lease_seconds
        # The index's own memory is bounded too (about 0.3 KiB per chunk): beyond this many chunks,
        # stored or reserved, the least valuable is evicted as when bytes run out.
        self.max_chunks = max_chunks
        self.counters = Counters()
        self.lower: LowerTier | None = None
        self._clock = clock
        self._lock = threading.RLock()
        self._alloc = Allocator(arena.capacity, arena.base)
        self._entries: dict[str, Entry] = {}
        # Evictable order: per priority value an LRU of stored entries (oldest first).
        self._lru: dict[int, OrderedDict[str, Entry]] = {}
        self._priorities: list[int] = []  # sorted keys of _lru
        self._leases: dict[str, Lease] = {}
        self._tick = itertools.count(1)
        self._stored_bytes = 0
        self._next_reap = 0.0
        # Generations start at a random number, so a restarted sidecar never accepts an old one.
        self._gens = itertools.count(secrets.randbits(62) + 1)
        self._promoting: dict[str, threading.Event] = {}  # key -> set when its promotion ends
        self._released: dict[str, None] = {}  # leases released before they were pinned (bounded, FIFO)

    # --- index bookkeeping (callers hold the lock) ------------------------------------------------

    def _touch(self, e: Entry) -> None:
        e.last_use = next(self._tick)
        self._lru[e.priority].move_to_end(e.key)

    def _link(self, e: Entry) -> None:
        lru = self._lru.get(e.priority)
        if lru is None:
            lru = self._lru[e.priority] = OrderedDict()
            bisect.insort(self._priorities, e.priority)
        lru[e.key] = e
        e.last_use = next(self._tick)

    def _unlink(self, e: Entry) -> None:
        lru = self._lru[e.priority]
        del lru[e.key]
        if not lru:
            del self._lru[e.priority]
            self._priorities.remove(e.priority)

    def _drop(self, e: Entry) -> None:
        """Takes an entry out of the index; frees its bytes now, or when its last pin is released."""
        if e.dropped:
            return
        e.dropped = True
        if self._entries.get(e.key) is e:
            del self._entries[e.key]
        if e.stored:
            self._unlink(e)
            self._stored_bytes -= e.length
        if e.pins == 0:
            self._alloc.free(e.offset, e.length)

    def _unpin(self, e: Entry) -> None:
        e.pins -= 1
        if e.pins == 0 and e.dropped:
            self._alloc.free(e.offset, e.length)

    def _victim(self, protect: set[str]) -> Entry | None:
        # A higher priority number is a lower priority (vLLM's convention): it goes first.
        for prio in reversed(self._priorities):
            for e in self._lru[prio].values():
                if e.pins == 0 and e.key not in protect:
                    return e
        return None

    def _allocate(self, length: int, protect: set[str]) -> int | None:
        if self._alloc.footprint(length) > self.capacity:
            return None
        while len(self._entries) >= self.max_chunks:
            victim = self._victim(protect)
            if victim is None:
                return None
            self._drop(victim)
            self.counters.evictions += 1
        while True:
            offset = self._alloc.alloc(length)
            if offset is not None:
                return offset
            victim = self._victim(protect)
            if victim is None:
                return None
            self._drop(victim)
            self.counters.evictions += 1

    def _reap(self) -> None:
        now = self._clock()
        if now < self._next_reap:
            return
        self._next_reap = now + min(1.0, self.lease_seconds / 4)
        for lease_id in [lid for lid, lease in self._leases.items() if lease.deadline <= now]:
            lease = self._leases.pop(lease_id)
            lease.expired = True
            for e in lease.entries:
                self._unpin(e)
            self.counters.leases_expired += 1
        for e in [e for e in self._entries.values() if not e.stored and e.deadline <= now]:
            self._drop(e)
            self.counters.reservations_expired += 1

    # --- the arena protocol -----------------------------------------------------------------------

    def reserve(
        self, items: Sequence[tuple[str, int]], priority: int = 0, groups: Mapping[str, str] | None = None
    ) -> list[Slot | None]:
        """Room for each (key, length): None where the key is stored or being written, or no room.
        A key that is stored already counts as used now: a hot prefix saved again stays recent.
        groups: key -> the chunk it is one rank's copy of (see LowerTier.saved)."""
        out: list[Slot | None] = []
        groups = groups or {}
        batch = {k for k, _ in items}
        # In slices, the lock released between them: a huge batch never holds lookups for long.
        for start in range(0, len(items), _SLICE):
            out += self._reserve_slice(items[start : start + _SLICE], batch, priority, groups)
        return out

    def _reserve_slice(
        self, items: Sequence[tuple[str, int]], batch: set[str], priority: int, groups: Mapping[str, str]
    ) -> list[Slot | None]:
        out: list[Slot | None] = []
        with self._lock:
            self._reap()
            deadline = self._clock() + self.lease_seconds
            for key, length in items:
                e = self._entries.get(key)
                if e is not None:
                    if e.stored:
                        self._touch(e)
                    out.append(None)
                    continue
                offset = self._allocate(length, batch)
                if offset is None:
                    out.append(None)
                    continue
                gen = next(self._gens)
                self._entries[key] = Entry(
                    key, offset, length, priority, deadline=deadline, gen=gen, group=groups.get(key)
                )
                out.append(Slot(key, offset, length, gen=gen, epoch=self.arena.epoch))
        return out

    def _reserved(self, slot: Slot) -> Entry | None:
        """The entry `slot` reserved, if it is still that writer's reservation."""
        e = self._entries.get(slot.key)
        if e is None or e.stored or e.gen != slot.gen or (e.offset, e.length) != (slot.offset, slot.length):
            return None
        if e.deadline <= self._clock():  # expired, though not reaped yet: no longer the writer's
            return None
        return e

    def renew(self, slot: Slot) -> bool:
        """Extends a reservation that is being written (a streamed body); False when it is no longer
        the writer's (expired, or the sidecar restarted): the writer must stop writing at once."""
        with self._lock:
            e = self._reserved(slot)
            if e is not None:
                e.deadline = self._clock() + self.lease_seconds
            return e is not None

    def commit(self, items: Sequence[tuple[Slot, int]]) -> list[bool]:
        """Makes reserved slots loadable with the checksum of their bytes, computed by the writer over
        its source; False (counted) where the slot is no longer that writer's reservation."""
        done: list[bool] = []
        saved: list[tuple[str, int, str | None]] = []
        with self._lock:
            for slot, digest in items:
                e = self._reserved(slot)
                if e is None:
                    self.counters.refused_commits += 1
                    done.append(False)
                    continue
                e.stored = True
                e.checksum = digest
                self._link(e)
                self._stored_bytes += e.length
                self.counters.bytes_in += e.length
                saved.append((e.key, e.length, e.group))
                done.append(True)
        if self.lower is not None:
            for key, length, group in saved:
                self.lower.saved(key, length, group)
        return done

    def abort(self, slots: Sequence[Slot]) -> None:
        with self._lock:
            for slot in slots:
                if (e := self._reserved(slot)) is not None:
                    self._drop(e)

    def pin(
        self,
        keys: Sequence[str],
        *,
        promote: bool = True,
        account: bool = True,
        verify: bool = True,
        lease_id: str | None = None,
    ) -> tuple[str, list[Slot]]:
        """Pins the longest loadable prefix of `keys`, promoting from Redis when needed. The slots carry
        their checksums; with verify=False the caller checks the bytes itself (see verify()).
        lease_id: the caller's name for the lease, so that a caller whose pin timed out can release
        it (even before the pin is done: then it pins nothing)."""
        lease_id = lease_id or secrets.token_hex(16)
        entries: list[Entry] = []
        with self._lock:
            self._reap()
            if lease_id in self._leases or lease_id in self._released:
                return lease_id, []  # released by a caller that gave up on it, or a name in use
            for key in keys:
                e = self._entries.get(key)
                if e is None or not e.stored:
                    break
                e.pins += 1
                self._touch(e)
                entries.append(e)
            # Registered now so an expired client leaks nothing even while we verify below.
            lease = self._leases[lease_id] = Lease(entries, self._clock() + self.lease_seconds)
        good = self._verify_prefix(entries) if verify else len(entries)
        with self._lock:
            if not lease.expired:
                for e in entries[good:]:
                    self._unpin(e)
            del entries[good:]
        if promote and len(entries) < len(keys):  # a corrupt chunk may still have a good copy in Redis
            self._promote_into(keys[len(entries) :], lease)
        with self._lock:
            if lease.expired:  # expired while we worked: hand nothing out
                return lease_id, []
            if account:
                self.counters.bytes_out += sum(e.length for e in entries)
            epoch = self.arena.epoch
            return lease_id, [Slot(e.key, e.offset, e.length, e.checksum, epoch=epoch) for e in entries]

    def release(self, lease_id: str) -> bool:
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is None:  # perhaps not pinned yet (a caller that timed out): never pin it then
                self._released[lease_id] = None
                if len(self._released) > 4096:
                    del self._released[next(iter(self._released))]
                return False
            lease.expired = True  # a promotion still running for it pins nothing more
            for e in lease.entries:
                self._unpin(e)
            return True

    def _verify_prefix(self, entries: list[Entry]) -> int:
        """Checks each pinned entry's bytes; drops the first bad one and returns how many are good."""
        for i, e in enumerate(entries):
            if not self._intact(e):
                return i
        return len(entries)

    def _intact(self, e: Entry) -> bool:
        """Whether a pinned entry's bytes still match its checksum; drops and counts it when not."""
        if checksum(self.arena.view[e.offset : e.offset + e.length]) == e.checksum:
            return True
        log.warning("chunk %s changed in the arena behind the sidecar: dropped", e.key)
        with self._lock:
            self.counters.corrupt_dropped += 1
            self._drop(e)
        return False

    def verify(self, keys: Sequence[str]) -> list[str]:
        """Checks the stored bytes of `keys` (a client that pinned with verify=False found them wrong,
        or wants them checked); drops and returns those that fail. The sidecar's checksum decides."""
        dropped = []
        for key in keys:
            with self._lock:
                e = self._entries.get(key)
                if e is None or not e.stored:
                    continue
                e.pins += 1  # neither evicted nor reused while we read it
            try:
                if not self._intact(e):
                    dropped.append(key)
            finally:
                with self._lock:
                    self._unpin(e)
        return dropped

    def _promote_into(self, keys: Sequence[str], lease: Lease) -> None:
        """Loads chunks from the lower tier into the arena, pinned under the caller's lease."""
        lower = self.lower
        if lower is None or not lower.usable():
            return
        for key in keys:
            if not self._promote(key, lease):
                return

    def _pin_into(self, e: Entry, lease: Lease) -> bool:
        if lease.expired:
            return False
        e.pins += 1
        self._touch(e)
        lease.entries.append(e)
        return True

    def _promote(self, key: str, lease: Lease) -> bool:
        """Pins `key` from the lower tier into the arena. A second promotion of the same key waits for
        the first and takes its result instead of failing."""
        while True:
            with self._lock:
                e = self._entries.get(key)
                if e is not None and e.stored:  # someone promoted or saved it meanwhile
                    return self._pin_into(e, lease)
                running = self._promoting.get(key)
                if running is None:
                    if e is not None:  # being written by a client: not loadable yet
                        return False
                    done = self._promoting[key] = threading.Event()
                    break
            if not running.wait(self.lease_seconds):
                return False
        try:
            return self._promote_now(key, lease)
        finally:
            with self._lock:
                del self._promoting[key]
            done.set()

    def _promote_now(self, key: str, lease: Lease) -> bool:
        assert self.lower is not None
        fetched = self.lower.fetch(key)
        if fetched is None:
            return False
        protect = {e.key for e in lease.entries}
        with self._lock:
            if key in self._entries:
                return False
            offset = self._allocate(fetched.length, protect)
            if offset is None:
                return False
            deadline = self._clock() + self.lease_seconds
            e = Entry(key, offset, fetched.length, fetched.priority, deadline=deadline, gen=next(self._gens))
            self._entries[key] = e
        # checked over the pieces we were given, never over the arena (which others map)
        ok = sum(map(len, fetched.pieces)) == fetched.length and (
            checksum_pieces(fetched.pieces) == fetched.checksum
        )
        pos = offset
        for piece in fetched.pieces if ok else ():
            self.arena.view[pos : pos + len(piece)] = piece
            pos += len(piece)
        with self._lock:
            if not ok:
                log.warning("chunk %s from the lower tier failed its checksum: not served, deleted", key)
                self.counters.corrupt_dropped += 1
                self._drop(e)
        if not ok:  # what is left there is no use to anyone: gone, so the next save writes it anew
            self.lower.deleted(key)
            return False
        with self._lock:
            if e.dropped:  # the reservation expired meanwhile
                return False
            e.stored = True
            e.checksum = fetched.checksum
            self._link(e)
            self._stored_bytes += e.length
            self.counters.promotions += 1
            return self._pin_into(e, lease)

    def describe(self, key: str) -> tuple[int, int] | None:
        """(checksum, priority) of a stored chunk."""
        with self._lock:
            e = self._entries.get(key)
            return (e.checksum, e.priority) if e is not None and e.stored else None

    @contextlib.contextmanager
    def pinned(
        self, keys: Sequence[str], *, promote: bool = True, account: bool = True
    ) -> Iterator[list[Slot]]:
        lease_id, slots = self.pin(keys, promote=promote, account=account)
        try:
            yield slots
        finally:
            self.release(lease_id)

    # --- whole-chunk operations (HTTP octet-stream, tools) ----------------------------------------

    def cpu_prefix(self, keys: Sequence[str], touch: bool = False) -> int:
        """How many of `keys`, from the first, are in the CPU tier now. With touch, those count as
        used now: a shared system prompt that every request looks up is never the first evicted."""
        with self._lock:
            n = 0
            for key in keys:
                e = self._entries.get(key)
                if e is None or not e.stored:
                    break
                if touch:
                    self._touch(e)
                n += 1
            return n

    def needs_lower(self, keys: Sequence[str]) -> bool:
        """Whether a lookup of `keys` would ask the lower tier (network I/O: keep it off the loop)."""
        lower = self.lower
        return lower is not None and lower.usable() and self.cpu_prefix(keys) < len(keys)

    def lookup(self, keys: Sequence[str]) -> int:
        n = self.cpu_prefix(keys, touch=True)
        lower = self.lower
        if n < len(keys) and lower is not None and lower.usable():
            for found in lower.exists_many(keys[n:]):
                if not found:
                    break
                n += 1
        with self._lock:
            self.counters.hits += n
            self.counters.misses += len(keys) - n
        return n

    def put(self, key: str, data: bytes | bytearray | memoryview, priority: int = 0) -> PutResult:
        result, slot = self.reserve_one(key, len(data), priority)
        if slot is None:
            return result
        try:
            self.arena.view[slot.offset : slot.offset + slot.length] = data
        except BaseException:
            self.abort([slot])
            raise
        return self.commit_one(slot, checksum(data))

    def reserve_one(self, key: str, length: int, priority: int = 0) -> tuple[PutResult, Slot | None]:
        with self._lock:
            e = self._entries.get(key)
            if e is not None:
                return (PutResult.EXISTS if e.stored else PutResult.BUSY), None
            (slot,) = self.reserve([(key, length)], priority)
            return (PutResult.CREATED if slot else PutResult.FULL), slot

    def commit_one(self, slot: Slot, digest: int) -> PutResult:
        """Commits one slot with the checksum of the writer's source bytes."""
        (ok,) = self.commit([(slot, digest)])
        return PutResult.CREATED if ok else PutResult.EXPIRED

    def get(self, key: str) -> bytes | None:
        """A copy of the chunk's bytes, checked after copying: what is returned is what was saved."""
        data = None
        with self._lock:
            e = self._entries.get(key)
            if e is not None and e.stored:
                e.pins += 1
                self._touch(e)
            else:
                e = None
        if e is not None:
            try:
                data = bytes(self.arena.view[e.offset : e.offset + e.length])
                bad = checksum(data) != e.checksum
            finally:
                with self._lock:
                    self._unpin(e)
            if bad:
                log.warning("chunk %s changed in the arena behind the sidecar: dropped", key)
                with self._lock:
                    self.counters.corrupt_dropped += 1
                    self._drop(e)
                data = None
            else:
                with self._lock:
                    self.counters.bytes_out += len(data)
        if data is None and self.lower is not None:
            with self.pinned([key]) as slots:  # a miss here looks in Redis and promotes
                if slots:
                    data = bytes(self.arena.view[slots[0].offset : slots[0].offset + slots[0].length])
        with self._lock:
            if data is not None:
                self.counters.hits += 1
            else:
                self.counters.misses += 1
        return data

    def delete(self, key: str) -> bool:
        with self._lock:
            e = self._entries.get(key)
            if e is not None and e.stored:
                self._drop(e)
                found = True
            else:
                found = False
        lower = self.lower
        if lower is not None:
            lower.deleted(key)
        return found

    # --- observation -------------------------------------------------------------------------------

    def stored_bytes(self) -> int:
        return self._stored_bytes

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            self._reap()
            c = self.counters
            return {
                "hits": c.hits,
                "misses": c.misses,
                "stored_bytes": self._stored_bytes,
                "capacity_bytes": self.capacity,
                "chunks": sum(len(lru) for lru in self._lru.values()),
                "evictions": c.evictions,
                "bytes_in": c.bytes_in,
                "bytes_out": c.bytes_out,
                "corrupt_dropped": c.corrupt_dropped,
                "reservations_expired": c.reservations_expired,
                "leases_expired": c.leases_expired,
                "promotions": c.promotions,
                "refused_commits": c.refused_commits,
                "reserved_chunks": sum(1 for e in self._entries.values() if not e.stored),
                "pinned_leases": len(self._leases),
                "free_bytes": self._alloc.free_bytes,
            }
