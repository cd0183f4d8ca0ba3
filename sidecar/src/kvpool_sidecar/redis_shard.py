"""The Redis tier's shards: each one's clients and health, the set of them, and which holds a key."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import redis
from redis.cluster import RedisCluster

from kvpool_sidecar.redis_connect import connect, redact
from kvpool_sidecar.wire import checksum

log = logging.getLogger(__name__)

T = TypeVar("T")

# Lookups run inside vLLM's schedule(): a hung shard may hold one only this long, then it is marked
# down (the health thread brings it back) and lookups answer from the CPU tier alone.
LOOKUP_BUDGET_SECONDS = 0.1


@dataclass(eq=False)
class Shard:
    url: str = field(repr=False)  # as given (may hold a password): never logged
    password: str | None = field(default=None, repr=False)
    client: redis.Redis | RedisCluster | None = None  # made by check(): a cluster client connects at once
    lookup_client: redis.Redis | RedisCluster | None = None  # the same, with LOOKUP_BUDGET_SECONDS
    name: str = ""
    up: bool = False
    reason: str = "not checked yet"

    def __post_init__(self) -> None:
        self.name = redact(self.url)
        self._id = self.name.encode()

    def check(self) -> None:
        """PING (connecting first if needed) and the eviction policy; marks the shard up or down with
        the reason."""
        try:
            if self.client is None:
                self.client = connect(self.url, self.password)
            if self.lookup_client is None:
                self.lookup_client = connect(self.url, self.password, LOOKUP_BUDGET_SECONDS)
            self.client.ping()
            problem = eviction_problem(self.client)
        except Exception as e:  # connection errors, auth, a bad URL, a cluster without slots
            self.down(e)
            return
        if problem is not None:
            if self.reason != problem:
                log.error("redis shard %s refused: %s", self.name, problem)
            self.up, self.reason = False, problem
            return
        if not self.up:
            log.info("redis shard %s is up", self.name)
        self.up, self.reason = True, "ok"

    @property
    def redis(self) -> redis.Redis | RedisCluster:
        """The client; a shard is used only after check() made it."""
        if self.client is None:
            raise redis.ConnectionError(f"shard {self.name} not connected yet")
        return self.client

    def close(self) -> None:
        for client in (self.client, self.lookup_client):
            if client is not None:
                client.close()

    def score(self, key: str) -> int:
        return checksum(self._id + key.encode())

    def down(self, error: BaseException) -> None:
        if self.up:
            log.warning("redis shard %s is down: %r", self.name, error)
        self.up = False
        self.reason = f"{type(error).__name__}: {error}"


def eviction_problem(client: redis.Redis | RedisCluster) -> str | None:
    """Why this Redis would refuse kvpool's writes once full, or None. kvpool's chunks have no TTL:
    with a memory limit only an allkeys-* policy ever evicts them, and Redis's default (noeviction)
    answers every write with OOM once full."""
    try:
        info = client.info("memory")
    except redis.ResponseError:  # INFO not allowed to this user: nothing to check
        return None
    nodes = list(info.values()) if info and all(isinstance(v, dict) for v in info.values()) else [info]
    for node in nodes:  # a cluster client answers per node
        maxmemory, policy = int(node.get("maxmemory", 0)), str(node.get("maxmemory_policy", ""))
        if maxmemory and not policy.startswith("allkeys-"):
            return (
                f"maxmemory {maxmemory} with maxmemory-policy {policy}: kvpool's chunks have no TTL, so "
                "this Redis would refuse every write once full; set maxmemory-policy allkeys-lru"
            )
    return None


class Shards:
    """The shards in use: from the URLs given, or from --redis-urls-file, which refresh() reads again
    when it changed; holder() picks a key's by rendezvous hashing."""

    def __init__(self, urls: Sequence[str], password: str | None, urls_file: Path | None) -> None:
        self.password = password
        self.urls_file = urls_file
        self.current: list[Shard] = []  # replaced whole, never changed in place: read without the lock
        self._lock = threading.Lock()
        self._file_state: tuple[float, int] | None = None
        self._set_urls(self._read_urls_file() or urls)

    def set_password(self, password: str | None) -> None:
        """A new password: every shard reconnects with it at its next check."""
        with self._lock:
            self.password = password
            shards, self.current = self.current, [Shard(s.url, password) for s in self.current]
        for old in shards:
            old.close()

    def _set_urls(self, urls: Sequence[str]) -> None:
        with self._lock:
            old = {s.url: s for s in self.current}
        shards = [old.pop(u) if u in old else Shard(u, self.password) for u in dict.fromkeys(urls)]
        with self._lock:
            self.current = shards
        for gone in old.values():
            gone.close()
        log.info("redis tier shards: %s", ", ".join(s.name for s in shards) or "none")

    def _read_urls_file(self) -> list[str] | None:
        """The shard list from --redis-urls-file; None when absent or unchanged since the last read."""
        if self.urls_file is None:
            return None
        try:
            st = self.urls_file.stat()
            state = (st.st_mtime, st.st_size)
            if state == self._file_state:
                return None
            text = self.urls_file.read_text()
        except OSError as e:
            log.warning("cannot read %s: %r", self.urls_file, e)
            return None
        self._file_state = state
        return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]

    def refresh(self) -> None:
        """Takes up the URL file's list if it changed, then checks every shard."""
        urls = self._read_urls_file()
        if urls is not None and urls != [s.url for s in self.current]:
            self._set_urls(urls)
        self.check()

    def check(self) -> None:
        for s in self.current:
            s.check()

    def holder(self, key: str) -> Shard | None:
        """The shard that holds `key`, up or not; None without shards."""
        shards = self.current
        return max(shards, key=lambda s: s.score(key)) if shards else None

    def by_holder(self, items: Iterable[T], key: Callable[[T], str]) -> list[tuple[Shard, list[T]]]:
        """`items` grouped by the shard that holds each one's key (one pipeline a shard), in their
        order; those of shards that are down are left out."""
        groups: dict[int, tuple[Shard, list[T]]] = {}
        for item in items:
            shard = self.holder(key(item))
            if shard is not None and shard.up:
                groups.setdefault(id(shard), (shard, []))[1].append(item)
        return list(groups.values())

    def health(self) -> tuple[bool, str]:
        shards = self.current
        if not shards:
            return False, "redis tier configured but no shard URLs (check --redis-urls-file)"
        down = [s for s in shards if not s.up]
        if down:
            return False, "redis unreachable: " + "; ".join(f"{s.name}: {s.reason}" for s in down)
        return True, "ok"

    def close(self) -> None:
        for s in self.current:
            s.close()
