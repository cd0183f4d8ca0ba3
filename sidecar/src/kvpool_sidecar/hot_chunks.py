"""The pool's hottest chunks, kept in its Redis tier, and the pre-warm of a new sidecar from them.

A new pod (a rollout, a scale-up) starts with an empty CPU tier, so each of its first returning
requests waits on Redis. Every sidecar counts the chunks its clients load; its Redis health thread
adds the counts to a sorted set on the shard that holds each chunk, trimmed to the HOT_KEEP hottest,
about once a second (never on a request's path). Every HALF_LIFE_SECONDS the first sidecar to
report halves every score of a set, so the set follows what the pool uses now, not last week.

A sidecar started with --prewarm-bytes reads every shard's set once its tier is usable and promotes
the hottest chunks it does not hold, in the background, while it serves: at most that many bytes,
into free room only, so it never evicts what it holds (adopted chunks after a restart).

The set's name carries a fingerprint of the pool key: pools sharing one external Redis never pre-warm
from each other's set (whose chunks would fail this pool's MAC, and be deleted as forgeries).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import redis

if TYPE_CHECKING:
    from kvpool_sidecar.redis_shard import Shards
    from kvpool_sidecar.store import Store

log = logging.getLogger(__name__)

HOT_KEEP = 4096  # members each shard's set keeps: 4,096 chunks of 256 tokens is ~1M tokens of prefixes
PENDING_MAX = 16_384  # distinct chunks counted between two reports; more wait for the next round
PREWARM_WAIT_SECONDS = 120.0  # how long a pre-warm waits for its tier to become usable
HALF_LIFE_SECONDS = 600  # a load counts half as much after this long

_ERRORS = (redis.RedisError, OSError)


def hot_set_name(pool_key: bytes | None) -> str:
    if pool_key is None:
        return "kvpool:hot:v1"
    return "kvpool:hot:v1:" + hashlib.sha256(b"kvpool-hot\0" + pool_key).hexdigest()[:16]


class HotChunks:
    """Loads counted here, reported to the shards' sets by report()."""

    def __init__(self, half_life: int = HALF_LIFE_SECONDS) -> None:
        self.half_life = half_life
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def loaded(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                if key in self._counts or len(self._counts) < PENDING_MAX:
                    self._counts[key] += 1

    def report(self, shards: Shards, set_name: str) -> int:
        """Adds the counts since the last report to each holder shard's set (one pipeline a shard),
        trims it, and halves it when its half-life is up (a marker key with that expiry, set by
        whichever of the pool's sidecars comes first); returns how many chunks were counted in. A
        shard that fails is marked down and its counts are let go: they are a hint, not data."""
        with self._lock:
            counts, self._counts = self._counts, Counter()
        reported = 0
        for shard, items in shards.by_holder(counts.items(), key=lambda kv: kv[0]):
            try:
                pipe = shard.redis.pipeline(transaction=False)
                for key, n in items:
                    pipe.execute_command("ZINCRBY", set_name, n, key)
                pipe.execute_command("ZREMRANGEBYRANK", set_name, 0, -HOT_KEEP - 1)
                pipe.execute_command("SET", f"{set_name}:halved", 1, "NX", "EX", self.half_life)
                if pipe.execute()[-1]:
                    shard.redis.execute_command("ZUNIONSTORE", set_name, 1, set_name, "WEIGHTS", 0.5)
                reported += len(items)
            except _ERRORS as e:
                shard.down(e)
        return reported


def hottest(shards: Shards, set_name: str, limit: int = HOT_KEEP) -> list[str]:
    """The pool's hottest chunk keys, hottest first, over every shard that is up."""
    scored: list[tuple[float, str]] = []
    for shard in shards.current:
        if not shard.up:
            continue
        try:
            members = cast(
                "list[tuple[bytes, float]]", shard.redis.zrevrange(set_name, 0, limit - 1, withscores=True)
            )
        except _ERRORS as e:
            shard.down(e)
            continue
        scored += [(score, member.decode()) for member, score in members]
    scored.sort(key=lambda s: -s[0])
    return list(dict.fromkeys(key for _, key in scored))[:limit]


@dataclass
class Prewarm:
    """A sidecar's pre-warm of its CPU tier from the pool's hottest chunks (at most once a start)."""

    budget: int  # bytes; 0: off
    state: str = "off"  # off, waiting (for the tier), running, done, or why it gave up
    chunks: int = 0
    bytes: int = 0

    def run(
        self,
        store: Store,
        keys: Callable[[], list[str]],
        usable: Callable[[], bool],
        stop: threading.Event,
    ) -> None:
        """Waits for the tier, then promotes the hottest chunks into free room until the budget or the
        free room is spent. `keys` reads the pool's hottest keys."""
        self.state = "waiting"
        deadline = time.monotonic() + PREWARM_WAIT_SECONDS
        while not usable():
            if stop.wait(0.2):
                return
            if time.monotonic() >= deadline:
                self.state = f"gave up: the Redis tier was not usable within {PREWARM_WAIT_SECONDS:.0f} s"
                log.warning("pre-warm %s", self.state)
                return
        self.state = "running"
        room = min(self.budget, store.snapshot()["free_bytes"])
        smallest = 1  # a pool's chunks are mostly one size: once less room is left, the rest won't fit
        for key in keys():
            if stop.is_set() or room < smallest:
                break
            taken = store.warm(key, within=room)
            if taken:
                smallest = taken if self.chunks == 0 else min(smallest, taken)
                room -= taken
                self.chunks += 1
                self.bytes += taken
        self.state = "done"
        log.info("pre-warmed %d chunks (%d bytes) from the pool's hottest", self.chunks, self.bytes)
