"""The CPU tier's index: where each chunk is in the arena, which are reserved or pinned, which go
first when room is needed, and the reservations' generations and leases.

Plain single-threaded code with an injected clock, tested in process (tests/sidecar/
test_sidecar_index.py). It never touches a chunk's bytes: the Store wraps it in one lock and does
the copies and checksums outside it, while the chunk is reserved or pinned.
"""

from __future__ import annotations

import bisect
import itertools
import secrets
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpool_sidecar.allocator import Allocator
from kvpool_sidecar.journal import Journal, Record
from kvpool_sidecar.wire import Slot


@dataclass(eq=False, slots=True)  # slots: --max-chunks entries must fit the sidecar's memory allowance
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
    prefixes: tuple[str, ...] = ()  # the keys of its block prefixes, which find it once stored


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
    arena_reinitialised: int = 0  # headers found changed behind the sidecar: every chunk dropped
    adopted: int = 0  # chunks a restarted sidecar found in the arena, whole, and serves again
    adoption_refused: int = 0  # chunks the journal named whose bytes no longer match: not adopted


class ChunkIndex:
    def __init__(
        self,
        capacity: int,
        base: int = 0,
        *,
        lease_seconds: float = 30.0,
        max_chunks: int = 200_000,
        clock: Callable[[], float],
    ) -> None:
        self.capacity = capacity
        self.lease_seconds = lease_seconds
        # The index's own memory is bounded too (per chunk: INDEX_BYTES_PER_CHUNK in the operator's
        # resources.py, measured): beyond this many chunks, stored or reserved, the least valuable is
        # evicted as when bytes run out.
        self.max_chunks = max_chunks
        self.counters = Counters()
        self.clock = clock
        self.stored_bytes = 0
        self._alloc = Allocator(capacity, base)
        self._entries: dict[str, Entry] = {}
        # A block prefix's key -> the stored chunk whose first blocks it is (the first one stored
        # wins). Prefix keys held by entries, reserved or stored, are at most max_chunks, so the
        # index's memory stays bounded whatever clients send; beyond that a chunk is saved without.
        self._aliases: dict[str, Entry] = {}
        self._prefixes_held = 0
        # Evictable order: per priority value an LRU of stored entries (oldest first).
        self._lru: dict[int, OrderedDict[str, Entry]] = {}
        self._priorities: list[int] = []  # sorted keys of _lru
        self._leases: dict[str, Lease] = {}
        self._released: dict[str, None] = {}  # leases released before they were pinned (bounded, FIFO)
        self._tick = itertools.count(1)
        self._next_reap = 0.0
        # Generations start at a random number, so a restarted sidecar never accepts an old one.
        self._gens = itertools.count(secrets.randbits(62) + 1)
        self.journal: Journal | None = None  # told of every chunk stored and dropped (journal.py)

    # --- lookups --------------------------------------------------------------------------------

    def entry(self, key: str) -> Entry | None:
        """The entry of `key`, stored or reserved."""
        return self._entries.get(key)

    def stored(self, key: str) -> Entry | None:
        e = self._entries.get(key)
        return e if e is not None and e.stored else None

    def loadable(self, key: str) -> Entry | None:
        """The stored chunk `key` names, or else the stored chunk whose first blocks are the block
        prefix `key` names (a load of those blocks reads that chunk and checks its whole checksum)."""
        return self.stored(key) or self._aliases.get(key)

    def prefix(self, keys: Sequence[str], touch: bool = False) -> int:
        """How many of `keys`, from the first, are stored. With touch, those count as used now: a
        shared system prompt that every request looks up is never the first evicted."""
        n = 0
        for key in keys:
            e = self.stored(key)
            if e is None:
                break
            if touch:
                self.touch(e)
            n += 1
        return n

    # --- reservations -----------------------------------------------------------------------------

    def reserve(
        self,
        key: str,
        length: int,
        priority: int,
        protect: set[str],
        group: str | None = None,
        prefixes: Sequence[str] = (),
        evict: bool = True,
    ) -> Entry | None:
        """A reservation of `length` bytes for `key`; None when the key is stored or being written
        (a stored one counts as used now: a hot prefix saved again stays recent), or no room even
        after evicting what is not in `protect` (evict=False: no room without evicting)."""
        e = self._entries.get(key)
        if e is not None:
            if e.stored:
                self.touch(e)
            return None
        offset = self._allocate(length, protect, evict)
        if offset is None:
            return None
        kept = tuple(prefixes[: max(0, self.max_chunks - self._prefixes_held)])
        self._prefixes_held += len(kept)
        e = Entry(
            key,
            offset,
            length,
            priority,
            deadline=self.clock() + self.lease_seconds,
            gen=next(self._gens),
            group=group,
            prefixes=kept,
        )
        self._entries[key] = e
        return e

    def reserved(self, slot: Slot) -> Entry | None:
        """The entry `slot` reserved, if it is still that writer's reservation (not expired, not
        taken over, from this sidecar)."""
        e = self._entries.get(slot.key)
        if e is None or e.stored or e.gen != slot.gen or (e.offset, e.length) != (slot.offset, slot.length):
            return None
        if e.deadline <= self.clock():  # expired, though not reaped yet: no longer the writer's
            return None
        return e

    def renew(self, slot: Slot) -> bool:
        e = self.reserved(slot)
        if e is not None:
            e.deadline = self.clock() + self.lease_seconds
        return e is not None

    def commit(self, slot: Slot, digest: int) -> Entry | None:
        """Makes a reservation loadable; None (counted) when it is no longer the writer's."""
        e = self.reserved(slot)
        if e is None:
            self.counters.refused_commits += 1
            return None
        self.store(e, digest)
        self.counters.bytes_in += e.length
        return e

    def store(self, e: Entry, digest: int) -> None:
        e.stored = True
        e.checksum = digest
        self._link(e)
        self.stored_bytes += e.length
        # only the aliases that got in are kept (a prefix another chunk already names costs nothing)
        mine = tuple(alias for alias in e.prefixes if self._aliases.setdefault(alias, e) is e)
        self._prefixes_held -= len(e.prefixes) - len(mine)
        e.prefixes = mine
        if self.journal is not None:
            self.journal.stored(e)
            self._compact_journal()

    def adopt(self, records: Sequence[Record]) -> int:
        """Takes chunks a previous run stored back into an empty index, each at its own extent (the
        caller has checked their bytes); one whose extent is out of range or taken is skipped.
        Returns how many were adopted."""
        adopted = 0
        for r in records:
            if r.key in self._entries or not self._alloc.take(r.offset, r.length):
                continue
            e = Entry(r.key, r.offset, r.length, r.priority, stored=True, checksum=r.checksum)
            self._entries[r.key] = e
            self._link(e)
            self.stored_bytes += e.length
            adopted += 1
        self.counters.adopted += adopted
        return adopted

    def held(self) -> list[Entry]:
        """Every stored chunk (what the journal is rewritten with)."""
        return [e for lru in self._lru.values() for e in lru.values()]

    def _compact_journal(self) -> None:
        if self.journal is not None and self.journal.due():
            self.journal.rewrite(self.held())

    def abort(self, slot: Slot) -> None:
        if (e := self.reserved(slot)) is not None:
            self.drop(e)

    # --- pins and leases ----------------------------------------------------------------------------

    def pin(self, e: Entry, use: bool = True) -> None:
        """Neither evicted nor its room reused until unpinned; `use`: a load, so it moves up the LRU."""
        e.pins += 1
        if use:
            self.touch(e)

    def unpin(self, e: Entry) -> None:
        e.pins -= 1
        if e.pins == 0 and e.dropped:
            self._alloc.free(e.offset, e.length)

    def lease(self, lease_id: str, entries: list[Entry]) -> Lease | None:
        """Registers a lease over pinned `entries`; None when the name was released before (its
        caller gave up on it) or is in use: then nothing may be pinned under it."""
        if lease_id in self._leases or lease_id in self._released:
            return None
        lease = self._leases[lease_id] = Lease(entries, self.clock() + self.lease_seconds)
        return lease

    def pin_into(self, e: Entry, lease: Lease) -> bool:
        if lease.expired:
            return False
        self.pin(e)
        lease.entries.append(e)
        return True

    def release(self, lease_id: str) -> bool:
        lease = self._leases.pop(lease_id, None)
        if lease is None:  # perhaps not pinned yet (a caller that timed out): never pin it then
            self._released[lease_id] = None
            if len(self._released) > 4096:
                del self._released[next(iter(self._released))]
            return False
        lease.expired = True  # a promotion still running for it pins nothing more
        for e in lease.entries:
            self.unpin(e)
        return True

    # --- recency, eviction, expiry ------------------------------------------------------------------

    def touch(self, e: Entry) -> None:
        e.last_use = next(self._tick)
        if e.stored and not e.dropped:
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

    def drop(self, e: Entry) -> None:
        """Takes an entry out of the index; frees its bytes now, or when its last pin is released."""
        if e.dropped:
            return
        e.dropped = True
        if self._entries.get(e.key) is e:
            del self._entries[e.key]
        for alias in e.prefixes:
            if self._aliases.get(alias) is e:
                del self._aliases[alias]
        self._prefixes_held -= len(e.prefixes)
        if e.stored:
            self._unlink(e)
            self.stored_bytes -= e.length
            if self.journal is not None:  # on file before the extent can go to another writer
                self.journal.dropped(e)
                self._compact_journal()
        if e.pins == 0:
            self._alloc.free(e.offset, e.length)

    def clear(self) -> None:
        """Drops every entry, stored or reserved. Pinned extents stay allocated until their leases
        end, so nothing a reader still copies from is handed to a new writer."""
        journal, self.journal = self.journal, None  # one rewrite, not a record per chunk
        for e in list(self._entries.values()):
            self.drop(e)
        self.journal = journal
        if journal is not None:
            journal.rewrite(())

    def _victim(self, protect: set[str]) -> Entry | None:
        # A higher priority number is a lower priority (vLLM's convention): it goes first.
        for prio in reversed(self._priorities):
            for e in self._lru[prio].values():
                if e.pins == 0 and e.key not in protect:
                    return e
        return None

    def _evict(self, protect: set[str]) -> bool:
        victim = self._victim(protect)
        if victim is None:
            return False
        self.drop(victim)
        self.counters.evictions += 1
        return True

    def _allocate(self, length: int, protect: set[str], evict: bool = True) -> int | None:
        if self._alloc.footprint(length) > self.capacity:
            return None
        while len(self._entries) >= self.max_chunks:
            if not evict or not self._evict(protect):
                return None
        while (offset := self._alloc.alloc(length)) is None:
            if not evict or not self._evict(protect):
                return None
        return offset

    def reap(self) -> None:
        """Ends the leases and reservations whose time is up (at most every lease_seconds / 4)."""
        now = self.clock()
        if now < self._next_reap:
            return
        self._next_reap = now + min(1.0, self.lease_seconds / 4)
        for lease_id in [lid for lid, lease in self._leases.items() if lease.deadline <= now]:
            lease = self._leases.pop(lease_id)
            lease.expired = True
            for e in lease.entries:
                self.unpin(e)
            self.counters.leases_expired += 1
        for e in [e for e in self._entries.values() if not e.stored and e.deadline <= now]:
            self.drop(e)
            self.counters.reservations_expired += 1

    # --- promotions from a lower tier ---------------------------------------------------------------

    def reserve_promotion(
        self,
        key: str,
        length: int,
        priority: int,
        protect: set[str],
        evict: bool = True,
        prefixes: Sequence[str] = (),
    ) -> Entry | None:
        """Room for a chunk being promoted (a reservation no client can commit: its generation is
        never handed out)."""
        if key in self._entries:
            return None
        return self.reserve(key, length, priority, protect, prefixes=prefixes, evict=evict)

    # --- observation -------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, int]:
        c = self.counters
        return {
            "hits": c.hits,
            "misses": c.misses,
            "stored_bytes": self.stored_bytes,
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
            "arena_reinitialised": c.arena_reinitialised,
            "adopted": c.adopted,
            "adoption_refused": c.adoption_refused,
            "reserved_chunks": sum(1 for e in self._entries.values() if not e.stored),
            "pinned_leases": len(self._leases),
            "free_bytes": self._alloc.free_bytes,
        }
