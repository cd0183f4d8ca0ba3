"""The Redis tier: write-behind of committed chunks, lookups and loads on a CPU miss, several shards.

- Saves never wait on Redis: committed keys go into a bounded queue; when it is full the save is
  simply not written behind (counted as dropped). One writer thread drains it, reading the bytes
  straight from the arena while the chunk is pinned (its checksum verified first).
- A chunk is one Redis hash: a small meta field and pieces of at most 4 MiB (Redis is slow with
  large values), all written by one HSET. Redis evicts and expires whole keys, so a chunk is in Redis
  whole or not at all: a lookup that finds the key finds every piece. The checksum in the meta is
  checked on every read; a read that finds anything wrong deletes the key, so the next save writes
  the chunk anew instead of every pod failing on it forever.
- Chunks cross pods here, so the meta carries a MAC, keyed by the pool's secret (KVPOOL_POOL_KEY),
  over the key, length, checksum and priority. A chunk whose MAC fails (planted by something without
  the secret, or written by another pool) is never promoted: it is a miss, deleted from Redis so the
  real chunk can be written, and counted (`auth_failures`). Without a key the tier trusts Redis.
- The password and the key may come from files (a mounted Secret, which the kubelet rewrites when the
  Secret changes), read again every health round: a Secret the operator had to make again reaches a
  running sidecar without a restart. Until it does, the old password or key is only ever a miss.
- A chunk's block prefixes (the keys a save names, which find it in the CPU tier) are written behind
  too, as aliases (a string per prefix, on the prefix's shard, first writer wins) naming the chunk
  under the pool's MAC: a lookup finds a prefix as it finds a chunk, and a load promotes the whole
  chunk and reads its first blocks, as from the CPU tier. A planted or other pool's alias is a miss.
- Shards are chosen by rendezvous hashing of the chunk key (adding a shard moves ~1/n of keys).
- A shard that fails is marked down at once and skipped (a miss, a dropped write) until the health
  thread's PING succeeds again; redis-py reconnects on the next command, so recovery needs nothing.
- The health thread also reports the chunks clients loaded to the pool's hot set, from which a new
  sidecar pre-warms its CPU tier (hot_chunks.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, cast

import redis

from kvpool_sidecar import metrics
from kvpool_sidecar.hot_chunks import HotChunks, Prewarm, hot_set_name, hottest
from kvpool_sidecar.promotion import Fetched
from kvpool_sidecar.redis_format import (
    MAGIC,
    META,
    META_FIELD,
    PIECE_BYTES,
    alias_key,
    alias_target,
    alias_value,
    chunk_key,
    chunk_mac,
    piece_count,
)
from kvpool_sidecar.redis_shard import Shard, Shards
from kvpool_sidecar.settings import Settings
from kvpool_sidecar.store import Store

log = logging.getLogger(__name__)

_ERRORS = (redis.RedisError, OSError)


def _read_secret(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:  # not there (yet): an optional Secret's file appears once the Secret does
        return None


def _delete(shard: Shard, key: str) -> None:
    shard.redis.delete(chunk_key(key))


@dataclass(slots=True)
class TierCounters:
    """Counted from the event loop, request threads and the writer thread: `add` under a lock, since
    `+=` from two threads can lose an increment."""

    written: int = 0
    dropped: int = 0  # saves not written behind: queue full, shard down, or evicted before their turn
    write_errors: int = 0
    bytes_written: int = 0
    hits: int = 0
    misses: int = 0
    read_errors: int = 0
    auth_failures: int = 0  # chunks whose MAC failed: never promoted, deleted from Redis
    bytes_read: int = 0
    hot_reported: int = 0  # chunk loads counted into the pool's hot set
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **increments: int) -> None:
        with self._lock:
            for name, n in increments.items():
                setattr(self, name, getattr(self, name) + n)


@dataclass(eq=False)
class RedisTier:
    store: Store
    urls: tuple[str, ...]
    password: str | None = None
    pool_key: bytes | None = field(default=None, repr=False)
    queue_bytes: int = 256 * 2**20
    urls_file: Path | None = None
    password_file: Path | None = None  # wins over `password` (see reload_credentials)
    pool_key_file: Path | None = None  # wins over `pool_key`
    pool_key_required: bool = False  # no key (yet): the tier stays off
    health_interval: float = 1.0
    prewarm_bytes: int = 0  # at start, promote up to this many bytes of the pool's hottest chunks
    counters: TierCounters = field(default_factory=TierCounters)

    def __post_init__(self) -> None:
        self._read_credential_files()
        self.shards = Shards(self.urls, self.password, self.urls_file)
        # (op, key, bytes): unbounded in entries, bounded in bytes (see saved)
        self._queue: queue.Queue[tuple[str, str, int]] = queue.Queue()
        self._queued_bytes = 0
        self._groups: OrderedDict[str, bool] = OrderedDict()  # the admission of each recent group
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.hot = HotChunks()
        self.prewarm = Prewarm(self.prewarm_bytes)

    @classmethod
    def from_settings(cls, settings: Settings, store: Store) -> RedisTier:
        return cls(
            store,
            settings.redis_urls,
            password=settings.redis_password,
            pool_key=settings.pool_key,
            queue_bytes=settings.redis_queue_bytes or settings.capacity // 2,
            urls_file=settings.redis_urls_file,
            password_file=settings.redis_password_file,
            pool_key_file=settings.pool_key_file,
            pool_key_required=settings.pool_key_required,
            prewarm_bytes=settings.prewarm_bytes,
        )

    def reload_credentials(self) -> None:
        """Takes up the password and key files' current values. A new password reconnects every shard."""
        if self._read_credential_files():
            self.shards.set_password(self.password)

    def _read_credential_files(self) -> bool:
        """An absent or empty file: none yet (an optional Secret not made yet). True: a new password."""
        if self.pool_key_file is not None:
            key = _read_secret(self.pool_key_file)
            new_key = key.encode() if key else None
            if new_key != self.pool_key:
                log.warning(
                    "the pool key is new (%s): chunks under another key are misses", self.pool_key_file
                )
                self.pool_key = new_key
        if self.password_file is not None:
            password = _read_secret(self.password_file)
            if password != self.password:
                log.warning("the redis password is new (%s): reconnecting", self.password_file)
                self.password = password
                return True
        return False

    # --- state --------------------------------------------------------------------------------------

    def usable(self) -> bool:
        return self._key_missing() is None and any(s.up for s in self.shards.current)

    def health(self) -> tuple[bool, str]:
        missing = self._key_missing()
        return (False, missing) if missing else self.shards.health()

    def _key_missing(self) -> str | None:
        if self.pool_key_required and self.pool_key is None:
            where = self.pool_key_file or "KVPOOL_POOL_KEY"
            return f"redis tier off: no pool key yet ({where}: is the pool's key Secret there?)"
        return None

    def stats(self) -> dict:
        """/stats' tiers.redis: the fields declared in metrics.REDIS_STATS (which /metrics renders)."""
        c = self.counters
        shards = self.shards.current
        ok, reason = self.health()
        values = {
            "ready": ok,
            "reason": reason,
            "shards": len(shards),
            "shards_up": sum(1 for s in shards if s.up),
            "queued": self._queue.qsize(),
            "queued_bytes": self._queued_bytes,
            "written": c.written,
            "dropped": c.dropped,
            "write_errors": c.write_errors,
            "bytes_written": c.bytes_written,
            "hits": c.hits,
            "misses": c.misses,
            "read_errors": c.read_errors,
            "auth_failures": c.auth_failures,
            "authenticated": self.pool_key is not None,
            "bytes_read": c.bytes_read,
            "hot_reported": c.hot_reported,
            "prewarm": self.prewarm.state,
            "prewarmed": self.prewarm.chunks,
            "prewarmed_bytes": self.prewarm.bytes,
        }
        return metrics.fields(metrics.REDIS_STATS, values, metrics.REDIS_TEXT_KEYS)

    # --- threads ------------------------------------------------------------------------------------

    def start(self) -> None:
        self.check_health()
        threads = [(self._write_loop, "kvpool-redis-writer"), (self._health_loop, "kvpool-redis-health")]
        if self.prewarm.budget > 0:
            threads.append((self._prewarm, "kvpool-prewarm"))
        for target, name in threads:
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(queue.Full):  # wake an idle writer; a busy one sees _stop next
            self._queue.put_nowait(("", "", 0))
        for t in self._threads:
            t.join(timeout=5)
        self.shards.close()

    def check_health(self) -> None:
        self.shards.check()

    def _health_loop(self) -> None:
        while not self._stop.wait(self.health_interval):
            try:
                self.reload_credentials()
                self.shards.refresh()
                if self._key_missing() is None:
                    self.counters.add(hot_reported=self.hot.report(self.shards, self._hot_set))
            except Exception:  # this thread is what brings Redis back: it must not die
                log.exception("redis health check failed")

    # --- the pool's hottest chunks ------------------------------------------------------------------

    @property
    def _hot_set(self) -> str:
        return hot_set_name(self.pool_key)

    def loaded(self, keys: Sequence[str]) -> None:
        self.hot.loaded(keys)

    def _prewarm(self) -> None:
        try:
            self.prewarm.run(self.store, lambda: hottest(self.shards, self._hot_set), self.usable, self._stop)
        except Exception as e:  # a pre-warm is an optimisation: the sidecar serves without it
            log.exception("pre-warm failed")
            self.prewarm.state = f"gave up: {e!r}"

    # --- write-behind -------------------------------------------------------------------------------

    def saved(self, key: str, length: int, group: str | None = None) -> None:
        """Called on commit: queue the chunk for Redis; never waits. The queue is bounded in bytes:
        a backlog longer than that would mostly be evicted from the arena before its turn. The ranks'
        copies of one chunk (one group) are all queued or all dropped: a chunk is a hit only when
        every rank has its copy, so a lone copy would only take room."""
        with self._lock:
            admitted = self._groups.get(group) if group else None
            if admitted is None:
                admitted = self._queued_bytes + length <= self.queue_bytes
                if group:
                    self._groups[group] = admitted
                    if len(self._groups) > 4096:
                        self._groups.popitem(last=False)
            if not admitted:
                self.counters.add(dropped=1)
                return
            self._queued_bytes += length
        self._queue.put_nowait(("set", key, length))

    def deleted(self, key: str) -> None:
        self._queue.put_nowait(("del", key, 0))

    def _write_loop(self) -> None:
        while not self._stop.is_set():
            op, key, length = self._queue.get()
            with self._lock:
                self._queued_bytes -= length
            if not key:
                continue
            try:
                if op == "set":
                    self.write(key)
                else:
                    self.remove(key)
            except Exception:  # never let the writer die
                log.exception("redis write-behind of %s failed", key)
                self.counters.add(write_errors=1)

    def write(self, key: str) -> bool:
        """Copies a chunk from the arena into its shard. False when not written (counted)."""
        shard = self.shards.holder(key)
        if shard is None or not shard.up or self._key_missing():
            self.counters.add(dropped=1)
            return False
        with self.store.pinned([key], promote=False, account=False) as slots:
            if not slots:  # evicted (or corrupt: dropped and counted by the store) before its turn
                self.counters.add(dropped=1)
                return False
            slot = slots[0]
            entry_meta = self.store.describe(key)
            if entry_meta is None:
                self.counters.add(dropped=1)
                return False
            digest, priority, prefixes = entry_meta
            view = self.store.arena.view[slot.offset : slot.offset + slot.length]
            try:
                # TOUCH: a chunk saved again is in use again, so Redis keeps it longer
                if shard.redis.touch(chunk_key(key)):
                    return True  # another pod wrote it already (whole: it is one key)
                n = piece_count(slot.length)
                mac = chunk_mac(self.pool_key, key, slot.length, digest, priority)
                fields: dict[str | bytes, bytes | memoryview] = {
                    str(i): view[i * PIECE_BYTES : (i + 1) * PIECE_BYTES] for i in range(n)
                }
                fields[META_FIELD] = META.pack(MAGIC, slot.length, digest, priority, n, mac)
                shard.redis.hset(chunk_key(key), mapping=fields)  # type: ignore[arg-type]  # one command: all or nothing
            except redis.exceptions.OutOfMemoryError:
                # full and unable to evict enough (a chunk larger than maxmemory allows): this write is
                # dropped, the shard still serves
                self.counters.add(dropped=1)
                return False
            except _ERRORS as e:
                shard.down(e)
                self.counters.add(write_errors=1)
                return False
            finally:
                view.release()
        self.counters.add(written=1, bytes_written=slot.length)
        self._write_aliases(key, prefixes)
        return True

    def _write_aliases(self, key: str, prefixes: Sequence[str]) -> None:
        """The chunk's block prefixes, each naming it from its own shard (one pipeline a shard). NX: the
        first chunk written for a prefix keeps it, as in the CPU tier; a failed shard loses only hits."""
        for shard, names in self.shards.by_holder(prefixes, key=str):
            try:
                pipe = shard.redis.pipeline(transaction=False)
                for prefix in names:
                    value = alias_value(self.pool_key, prefix, key)
                    pipe.execute_command("SET", alias_key(prefix), value, "NX")
                pipe.execute()
            except _ERRORS as e:
                shard.down(e)

    def remove(self, key: str) -> None:
        self._delete_held(key, chunk_key(key))

    def remove_alias(self, prefix: str) -> None:
        self._delete_held(prefix, alias_key(prefix))

    def _delete_held(self, key: str, name: str) -> None:
        """Deletes Redis key `name` from the shard that holds `key`, unless that shard is down."""
        shard = self.shards.holder(key)
        if shard is None or not shard.up:
            return
        try:
            shard.redis.delete(name)
        except _ERRORS as e:
            shard.down(e)

    # --- reads --------------------------------------------------------------------------------------

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is in Redis, as a chunk or a block prefix's alias: a pipelined TOUCH of both
        (it answers as EXISTS does, and counts as a use, so chunks that pods keep looking up stay the
        most recent under LRU eviction), one round trip per shard, within LOOKUP_BUDGET_SECONDS; a
        shard that is down, or does not answer in time (then marked down), says no. An alias whose
        chunk was evicted says yes: its load is a miss."""
        found = [False] * len(keys)
        for shard, idx in self.shards.by_holder(range(len(keys)), key=keys.__getitem__):
            try:
                assert shard.lookup_client is not None  # an up shard has both clients
                pipe = shard.lookup_client.pipeline(transaction=False)
                for i in idx:
                    # (not pipe.touch: in a cluster pipeline, redis-py's returns no replies; two
                    # commands, not one of two keys: in a cluster the keys' slots differ)
                    pipe.execute_command("TOUCH", chunk_key(keys[i]))
                    pipe.execute_command("TOUCH", alias_key(keys[i]))
                replies = pipe.execute()
                for i, as_chunk, as_alias in zip(idx, replies[::2], replies[1::2], strict=True):
                    found[i] = bool(as_chunk or as_alias)
            except _ERRORS as e:
                shard.down(e)
        return found

    def fetch(self, key: str) -> Fetched | None:
        """The chunk's pieces and meta from its shard (checked by the store against the checksum); or,
        where `key` is a block prefix's, the whole chunk its alias names."""
        fetched = self._fetch(key)
        if fetched is not False:
            return fetched
        target = self._alias_target(key)
        fetched = self._fetch(target) if target is not None else False
        if fetched is False:
            self.counters.add(misses=1)
            if target is not None:  # its chunk was evicted: let the next chunk saved with it have it
                self.remove_alias(key)
            return None
        return dataclasses.replace(fetched, key=target) if fetched is not None else None

    def _alias_target(self, prefix: str) -> str | None:
        """The chunk the alias of `prefix` names; None where there is none, or it fails the MAC
        (deleted, counted as the chunks' failures are)."""
        shard = self.shards.holder(prefix)
        if shard is None or not shard.up:
            return None
        try:
            value = cast("bytes | None", shard.redis.get(alias_key(prefix)))
            if value is None:
                return None
            target = alias_target(self.pool_key, prefix, value)
            if target is None:
                self.counters.add(auth_failures=1)
                log.warning("alias %s in redis shard %s is not this pool's: deleted", prefix, shard.name)
                self.remove_alias(prefix)
            return target
        except _ERRORS as e:
            shard.down(e)
            self.counters.add(read_errors=1)
            return None

    def _fetch(self, key: str) -> Fetched | Literal[False] | None:
        """The chunk stored under `key`; False when Redis has no such chunk, None when it could not be
        read (counted)."""
        shard = self.shards.holder(key)
        if shard is None or not shard.up:
            return None
        name = chunk_key(key)
        try:
            raw = cast("bytes | None", shard.redis.hget(name, META_FIELD))
            if raw is None:
                return False
            if len(raw) != META.size or raw[:4] != MAGIC:
                return self._unreadable(shard, key, "its meta is not kvpool's")
            _, length, digest, priority, n, mac = META.unpack(raw)
            if n != piece_count(length) or length > self.store.capacity:
                return self._unreadable(shard, key, "its meta is inconsistent")
            if self.pool_key is not None and not hmac.compare_digest(
                mac, chunk_mac(self.pool_key, key, length, digest, priority)
            ):
                self.counters.add(auth_failures=1)
                log.warning("chunk %s in redis shard %s fails the pool's MAC: deleted", key, shard.name)
                _delete(shard, key)
                return None
            # One HGET per piece, not a pipeline: hiredis parses a train of large replies at half
            # the speed of one at a time (measured 1.0 vs 2.0 GB/s for 4 MiB pieces), and a round
            # trip is small beside 4 MiB.
            got = [cast("bytes | None", shard.redis.hget(name, str(i))) for i in range(n)]
            pieces = [p for p in got if p is not None]
            if len(pieces) < n or sum(map(len, pieces)) != length:
                return self._unreadable(shard, key, "pieces are missing")
        except _ERRORS as e:
            shard.down(e)
            self.counters.add(read_errors=1)
            return None
        self.counters.add(hits=1, bytes_read=length)
        return Fetched(length=length, checksum=digest, priority=priority, pieces=pieces)

    def _unreadable(self, shard: Shard, key: str, why: str) -> Fetched | None:
        """A chunk no reader can use: deleted (what is left would look like a hit to every pod)."""
        self.counters.add(read_errors=1)
        log.warning("chunk %s in redis shard %s cannot be read (%s): deleted", key, shard.name, why)
        _delete(shard, key)
        return None
