"""What a pre-warm (spec.redis.prewarm) gives a new pod: its first returning prefix loaded from its own
CPU tier instead of promoted from Redis, and how long the pre-warm itself takes.

In process over a real redis-server on loopback, the sidecar's Store and RedisTier on tmpfs:
- the pool: one sidecar saves 256 chunks of 256 KiB (64 MiB) into Redis and loads them, the first 16
  (a returning 4,096-token prompt of a small model, 4 MiB) most; its loads go to the hot set;
- a new sidecar pins that prefix, without a pre-warm (each chunk promoted from Redis, the pin's
  caller waiting) and with a 64 MiB pre-warm done first, alternately, as a ratio per pair; and the
  pre-warm's own time (started as the sidecar starts, in the background, while it serves).
Run: `.venv/bin/python -m bench prewarm`.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.stats import Spread

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from kvtest import redis_server, wait_until

from kvpool_sidecar.arena import Arena
from kvpool_sidecar.redis_tier import RedisTier
from kvpool_sidecar.store import Store

CHUNK = 256 * 1024
CHUNKS = 256
PREFIX = 16
CAPACITY = 128 * 2**20
PAIRS = 7


@contextmanager
def sidecar(url: str, prewarm_bytes: int = 0) -> Iterator[RedisTier]:
    d = Path(tempfile.mkdtemp(dir="/dev/shm"))
    store = Store(Arena(d, CAPACITY))
    tier = RedisTier(store, (url,), prewarm_bytes=prewarm_bytes)
    store.lower = tier
    try:
        tier.start()
        yield tier
    finally:
        tier.close()
        store.arena.close()
        shutil.rmtree(d)


def _pin_seconds(store: Store, keys: list[str]) -> float:
    t0 = time.perf_counter()
    with store.pinned(keys) as slots:
        assert len(slots) == len(keys)
    return time.perf_counter() - t0


def main() -> None:
    keys = [f"{i:064x}" for i in range(CHUNKS)]
    with redis_server() as redis, sidecar(redis.url) as pool:
        for i, k in enumerate(keys):
            pool.store.put(k, bytes([i % 251]) * CHUNK)
        wait_until(lambda: pool.counters.written == CHUNKS, 120, "the write-behind")
        for _ in range(3):
            _pin_seconds(pool.store, keys[:PREFIX])
        for k in keys:
            _pin_seconds(pool.store, [k])
        wait_until(lambda: pool.counters.hot_reported >= CHUNKS, 30, "the hot set")

        cold, warm, ratios, prewarm = [], [], [], []
        for i in range(PAIRS):
            times = {}
            for warmed in (True, False) if i % 2 == 0 else (False, True):
                t0 = time.perf_counter()
                with sidecar(redis.url, prewarm_bytes=CHUNKS * CHUNK if warmed else 0) as new:
                    if warmed:
                        wait_until(lambda new=new: new.prewarm.state == "done", 120, "the pre-warm")
                        prewarm.append(time.perf_counter() - t0)
                        assert new.prewarm.chunks == CHUNKS
                    times[warmed] = _pin_seconds(new.store, keys[:PREFIX])
            warm.append(times[True] * 1e3)
            cold.append(times[False] * 1e3)
            ratios.append(times[True] / times[False])
    c, w, r, p = Spread.of(cold), Spread.of(warm), Spread.of(ratios), Spread.of(prewarm)
    mib = CHUNKS * CHUNK / 2**20
    print(f"a new sidecar's first load of a returning {PREFIX}-chunk prefix ({PREFIX * CHUNK >> 20} MiB), "
          f"{PAIRS} alternating pairs, median [min-max]:")  # fmt: skip
    print(f"  promoted from Redis (no pre-warm)  {c.median:7.2f} ms [{c.low:.2f}-{c.high:.2f}]")
    print(f"  pre-warmed (CPU tier)              {w.median:7.2f} ms [{w.low:.2f}-{w.high:.2f}]")
    print(f"  ratio                              {r.median:7.3f} [{r.low:.3f}-{r.high:.3f}]")
    print(f"the pre-warm of {mib:.0f} MiB from the sidecar's start: {p.median:.2f} s "
          f"[{p.low:.2f}-{p.high:.2f}] = {mib / p.median:.0f} MiB/s")  # fmt: skip
