"""The chunk store: the CPU tier over the arena, and the hooks to Redis.

A thin thread-safe shell, used by the asyncio handlers and by the Redis tier's threads: the index
(chunk_index.py, single-threaded) is changed under one lock; the byte work (copies, checksums,
promotions from Redis) runs outside it while the chunk is reserved or pinned, which is also what
keeps a chunk from being evicted or overwritten while it is in use.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from enum import Enum

from kvpool_sidecar.arena import Arena
from kvpool_sidecar.batching import LOCKED_SLICE
from kvpool_sidecar.chunk_index import ChunkIndex, Counters, Entry
from kvpool_sidecar.journal import Journal
from kvpool_sidecar.miss_ratio import MissRatioCurve, key_hashes
from kvpool_sidecar.promotion import LowerTier, Promotions
from kvpool_sidecar.wire import ARENA_HEADER, Slot, checksum
from kvpool_sidecar.working_set import WorkingSet

log = logging.getLogger(__name__)

__all__ = ["Counters", "PutResult", "Store"]


class PutResult(Enum):
    CREATED = "created"
    EXISTS = "exists"
    FULL = "full"  # no room even after eviction
    BUSY = "busy"  # another client is writing this key right now
    EXPIRED = "expired"  # the reservation expired while the body was written: nothing stored


class Store:
    def __init__(
        self,
        arena: Arena,
        *,
        lease_seconds: float = 30.0,
        max_chunks: int = 200_000,
        clock: Callable[[], float] = time.monotonic,
        journal: Journal | None = None,
    ):
        self.arena = arena
        self.capacity = arena.capacity
        self.lease_seconds = lease_seconds
        self.index = ChunkIndex(
            arena.capacity, arena.base, lease_seconds=lease_seconds, max_chunks=max_chunks, clock=clock
        )
        self.counters = self.index.counters
        self.lower: LowerTier | None = None
        self._lock = threading.RLock()
        self._promotions = Promotions(self.index, arena, self._lock, lease_seconds)
        self.arena_fault: str | None = None  # the last header found changed behind the sidecar
        self.curve = MissRatioCurve(arena.capacity)  # the hit rate at other capacities (sizing)
        self.working_set = WorkingSet()  # the distinct chunks asked for lately (the shared tier's sizing)
        if journal is not None:
            self._adopt(journal)

    def _adopt(self, journal: Journal) -> None:
        """At start, before serving: the chunks a previous run left in this same arena file whose bytes
        still match their checksums are served again; then every change goes on the journal."""
        records = journal.read() if self.arena.reused else {}
        end = self.arena.size
        whole = [
            r
            for r in records.values()
            if self.arena.base <= r.offset <= r.offset + r.length <= end
            and checksum(self.arena.view[r.offset : r.offset + r.length]) == r.checksum
        ]
        adopted = self.index.adopt(whole)
        refused = len(records) - adopted
        self.counters.adoption_refused += refused
        journal.rewrite(self.index.held())
        self.index.journal = journal
        if records:
            log.info("adopted %d chunks from the arena; %d torn or overwritten were not", adopted, refused)

    def _check_arena(self) -> None:
        """Before serving, under the lock: a header this sidecar did not write (a rogue writer, memory
        corruption) means clients refuse every offset it hands out, since its epoch is gone, and its
        bytes are suspect. Offering hits then only makes clients fail loads: drop every chunk and
        write a new header instead. Redis's copies are checksummed and stay."""
        if self.arena.header_intact():
            return
        magic, epoch = ARENA_HEADER.unpack_from(self.arena.view, 0)
        dropped = self.index.snapshot()["chunks"]
        self.index.clear()
        self.arena.new_epoch()
        self.counters.arena_reinitialised += 1
        self.arena_fault = (
            f"the arena's header changed behind the sidecar (magic {magic!r}, epoch {epoch}): "
            f"re-initialised with a new epoch, {dropped} chunks dropped"
        )
        log.error("%s", self.arena_fault)

    # --- the arena protocol -----------------------------------------------------------------------

    def reserve(
        self,
        items: Sequence[tuple[str, int]],
        priority: int = 0,
        groups: Mapping[str, str] | None = None,
        prefixes: Mapping[str, Sequence[str]] | None = None,
    ) -> list[Slot | None]:
        """Room for each (key, length): None where the key is stored or being written, or no room.
        groups: key -> the chunk it is one rank's copy of (see LowerTier.saved). prefixes: key -> the
        keys of its block prefixes (see ChunkIndex.loadable)."""
        groups, prefixes = groups or {}, prefixes or {}
        batch = {k for k, _ in items}
        out: list[Slot | None] = []
        # In slices, the lock released between them: a huge batch never holds lookups for long.
        for start in range(0, len(items), LOCKED_SLICE):
            with self._lock:
                self._check_arena()
                self.index.reap()
                for key, length in items[start : start + LOCKED_SLICE]:
                    e = self.index.reserve(
                        key, length, priority, batch, groups.get(key), prefixes.get(key, ())
                    )
                    out.append(None if e is None else self._slot(e, gen=e.gen))
        return out

    def _slot(self, e: Entry, gen: int = 0) -> Slot:
        return Slot(e.key, e.offset, e.length, e.checksum if e.stored else None, gen, self.arena.epoch)

    def holds(self, slot: Slot) -> bool:
        """Whether `slot` is still its writer's reservation (its room is taken)."""
        with self._lock:
            return self.index.reserved(slot) is not None

    def renew(self, slot: Slot) -> bool:
        """Extends a reservation that is being written (a streamed body); False when it is no longer
        the writer's (expired, or the sidecar restarted): the writer must stop writing at once."""
        with self._lock:
            return self.index.renew(slot)

    def commit(self, items: Sequence[tuple[Slot, int]]) -> list[bool]:
        """Makes reserved slots loadable with the checksum of their bytes, computed by the writer over
        its source; False (counted) where the slot is no longer that writer's reservation."""
        with self._lock:
            committed = [self.index.commit(slot, digest) for slot, digest in items]
        self.curve.committed((e.key, e.length) for e in committed if e is not None)
        if self.lower is not None:
            for e in committed:
                if e is not None:
                    self.lower.saved(e.key, e.length, e.group)
        return [e is not None for e in committed]

    def abort(self, slots: Sequence[Slot]) -> None:
        with self._lock:
            for slot in slots:
                self.index.abort(slot)

    def pin(
        self,
        keys: Sequence[str],
        *,
        promote: bool = True,
        account: bool = True,
        verify: bool = True,
        lease_id: str | None = None,
        within: int | None = None,
    ) -> tuple[str, list[Slot]]:
        """Pins the longest loadable prefix of `keys`, promoting from Redis when needed. The slots carry
        their checksums; with verify=False the caller checks the bytes itself (see verify()).
        lease_id: the caller's name for the lease, so that a caller whose pin timed out can release
        it (even before the pin is done: then it pins nothing). within: promote only into free room,
        and only chunks of at most that many bytes (see warm)."""
        lease_id = lease_id or secrets.token_hex(16)
        with self._lock:
            self._check_arena()
            self.index.reap()
            entries: list[Entry] = []
            # Registered before anything is pinned, so an expired client leaks nothing even while we
            # verify below.
            lease = self.index.lease(lease_id, entries)
            if lease is None:
                return lease_id, []  # released by a caller that gave up on it, or a name in use
            for key in keys:
                e = self.index.loadable(key)  # a block prefix's key pins the chunk that holds it
                if e is None:
                    break
                self.index.pin(e)
                entries.append(e)
        good = self._verify_prefix(entries) if verify else len(entries)
        with self._lock:
            if not lease.expired:
                for e in entries[good:]:
                    self.index.unpin(e)
            del entries[good:]
        if promote and len(entries) < len(keys):  # a corrupt chunk may still have a good copy in Redis
            self._promotions.promote_into(self.lower, keys[len(entries) :], lease, within)
        with self._lock:
            if lease.expired:  # expired while we worked: hand nothing out
                return lease_id, []
            if account:
                self.counters.bytes_out += sum(e.length for e in entries)
            slots = [self._slot(e) for e in entries]
        if account and slots and self.lower is not None:
            self.lower.loaded([s.key for s in slots])  # the pool's hottest chunks (hot_chunks.py)
        return lease_id, slots

    def warm(self, key: str, within: int) -> int:
        """Promotes `key` from the lower tier into free room only, evicting nothing (a pre-warm must
        not push out what this sidecar holds), if it is at most `within` bytes: the bytes it took, or 0
        (held already, not in the lower tier, larger, or no free extent for it)."""
        with self._lock:
            if self.index.entry(key) is not None:
                return 0
        lease_id, slots = self.pin([key], account=False, within=within)
        self.release(lease_id)
        return slots[0].length if slots else 0

    def release(self, lease_id: str) -> bool:
        with self._lock:
            return self.index.release(lease_id)

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
        self._corrupt(e)
        return False

    def _corrupt(self, e: Entry) -> None:
        log.warning("chunk %s changed in the arena behind the sidecar: dropped", e.key)
        with self._lock:
            self.counters.corrupt_dropped += 1
            self.index.drop(e)

    def verify(self, keys: Sequence[str]) -> list[str]:
        """Checks the stored bytes of `keys` (a client that pinned with verify=False found them wrong,
        or wants them checked); drops and returns those that fail. The sidecar's checksum decides."""
        with self._lock:
            self._check_arena()  # a client whose load failed may have found the header changed
        dropped = []
        for key in keys:
            with self._lock:
                e = self.index.stored(key)
                if e is None:
                    continue
                self.index.pin(e, use=False)  # held while we read it; a check is not a use
            try:
                if not self._intact(e):
                    dropped.append(key)
            finally:
                with self._lock:
                    self.index.unpin(e)
        return dropped

    def describe(self, key: str) -> tuple[int, int, tuple[str, ...]] | None:
        """(checksum, priority, the keys of the block prefixes that find it) of a stored chunk."""
        with self._lock:
            e = self.index.stored(key)
            return (e.checksum, e.priority, e.prefixes) if e is not None else None

    @contextlib.contextmanager
    def pinned(
        self, keys: Sequence[str], *, promote: bool = True, account: bool = True
    ) -> Iterator[list[Slot]]:
        lease_id, slots = self.pin(keys, promote=promote, account=account)
        try:
            yield slots
        finally:
            self.release(lease_id)

    # --- lookups --------------------------------------------------------------------------------------

    def cpu_prefix(self, keys: Sequence[str], touch: bool = False) -> int:
        """How many of `keys`, from the first, are in the CPU tier now (see ChunkIndex.prefix)."""
        with self._lock:
            self._check_arena()
            return self.index.prefix(keys, touch)

    def needs_lower(self, keys: Sequence[str]) -> bool:
        """Whether a lookup of `keys` would ask the lower tier (network I/O: keep it off the loop)."""
        lower = self.lower
        return lower is not None and lower.usable() and self.cpu_prefix(keys) < len(keys)

    def lookup(self, keys: Sequence[str]) -> int:
        n = self.cpu_prefix(keys, touch=True)
        hashes = key_hashes(keys)
        self.curve.looked_up(hashes)
        self.working_set.looked_up(hashes)
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

    def first_whole(self, groups: Sequence[Sequence[str]]) -> int | None:
        """The index of the first of `groups` whose keys can all be loaded now (its chunks in the CPU
        tier count as used now), or None. One round trip to the lower tier for all of them."""
        keys = list(dict.fromkeys(k for group in groups for k in group))
        with self._lock:
            self._check_arena()
            here = {k for k in keys if self.index.loadable(k) is not None}
        missing = [k for k in keys if k not in here]
        lower = self.lower
        if missing and lower is not None and lower.usable():
            here.update(k for k, found in zip(missing, lower.exists_many(missing), strict=True) if found)
        for i, group in enumerate(groups):
            if all(k in here for k in group):
                with self._lock:
                    for k in group:
                        if (e := self.index.loadable(k)) is not None:
                            self.index.touch(e)
                    self.counters.hits += len(group)
                return i
        return None

    # --- whole-chunk operations (HTTP octet-stream, tools) ----------------------------------------

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
            e = self.index.entry(key)
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
            self._check_arena()
            e = self.index.stored(key)
            if e is not None:
                self.index.pin(e)
        if e is not None:
            try:
                data = bytes(self.arena.view[e.offset : e.offset + e.length])
                bad = checksum(data) != e.checksum
            finally:
                with self._lock:
                    self.index.unpin(e)
            if bad:
                self._corrupt(e)
                data = None
            else:
                with self._lock:
                    self.counters.bytes_out += len(data)
                if self.lower is not None:  # (a promotion below is counted by pin)
                    self.lower.loaded([key])
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
            e = self.index.stored(key)
            if e is not None:
                self.index.drop(e)
        if self.lower is not None:
            self.lower.deleted(key)
        return e is not None

    # --- observation -------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            self.index.reap()
            return self.index.snapshot()
