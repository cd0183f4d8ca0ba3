"""The sidecar's miss-ratio curve against an exact LRU simulation of the same trace, and its cost.

A trace like a chat fleet's: requests share one of 300 documents (8 chunks each, Zipf popularity) and
carry their user's conversation so far (2,000 users, Zipf activity, each turn adding 1-3 chunks),
with 256 KiB chunks and a smaller last one. An exact byte-capacity LRU with the store's semantics (a
lookup's hit is the loadable prefix, its chunks touched in order; the rest is computed and saved) runs
at each of the curve's capacities and unbounded; the store at 1x feeds the curve what the sidecar
feeds it (every lookup, the commits of what missed). The error is the estimate minus the exact hit
rate, in percentage points. The cost is the curve's work per lookup as a ratio to the store's own
lookup of the same keys, timed alternately in the same run.
Run: `.venv/bin/python -m bench miss_ratio`.
"""

from __future__ import annotations

import hashlib
import random
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.stats import Spread

CHUNK = 256 * 1024
DOCS, DOC_CHUNKS, USERS = 300, 8, 2000
REQUESTS = 60_000
MAX_TURN_CHUNKS = 24
CAPACITY = 3000 * CHUNK  # the 1x tier: about a third of what the trace touches
REPEAT = 21


def _key(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def trace(requests: int = REQUESTS, seed: int = 0) -> Iterator[list[tuple[str, int]]]:
    """Requests as lists of (chunk key, size), each a prefix chain."""
    rng = random.Random(seed)
    docs = [1 / (i + 1) for i in range(DOCS)]
    users = [1 / (i + 1) ** 0.8 for i in range(USERS)]
    turns = [0] * USERS
    conversation = [0] * USERS
    doc_of = [rng.choices(range(DOCS), docs)[0] for _ in range(USERS)]
    for _ in range(requests):
        u = rng.choices(range(USERS), users)[0]
        turns[u] += rng.randint(1, 3)
        if turns[u] > MAX_TURN_CHUNKS:  # a new conversation, on another document
            turns[u], conversation[u] = 1, conversation[u] + 1
            doc_of[u] = rng.choices(range(DOCS), docs)[0]
        chunks = [(_key("doc", doc_of[u], i), CHUNK) for i in range(DOC_CHUNKS)]
        chunks += [(_key("user", u, conversation[u], i), CHUNK) for i in range(turns[u] - 1)]
        chunks.append((_key("user", u, conversation[u], turns[u] - 1), rng.randint(CHUNK // 8, CHUNK)))
        yield chunks


class ExactLru:
    """The store's semantics at one byte capacity (None: unbounded)."""

    def __init__(self, capacity: float | None) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[str, int] = OrderedDict()
        self.used = 0
        self.hits = self.misses = 0

    def request(self, chunks: list[tuple[str, int]]) -> int:
        n = 0
        for key, _ in chunks:
            if key not in self.entries:
                break
            self.entries.move_to_end(key)
            n += 1
        self.hits += n
        self.misses += len(chunks) - n
        for key, size in chunks[n:]:
            if key in self.entries:
                self.entries.move_to_end(key)
                continue
            self.entries[key] = size
            self.used += size
            while self.capacity is not None and self.used > self.capacity:
                self.used -= self.entries.popitem(last=False)[1]
        return n

    @property
    def hit_rate(self) -> float:
        return self.hits / (self.hits + self.misses)


def compare(
    requests: int, capacity: int, max_keys: int
) -> tuple[dict[str, Any], list[tuple[str, float, float]]]:
    """Runs the trace through the curve and the exact LRUs: the curve's snapshot, and per capacity (and
    the ceiling) its name, the exact hit rate and the curve's."""
    from kvpool_sidecar.miss_ratio import SCALES, MissRatioCurve, key_hashes

    curve = MissRatioCurve(capacity, max_keys=max_keys)
    exact = {scale: ExactLru(scale * capacity) for scale in SCALES}
    unbounded = ExactLru(None)
    for chunks in trace(requests):
        hits = {scale: lru.request(chunks) for scale, lru in exact.items()}
        unbounded.request(chunks)
        curve.looked_up(key_hashes([k for k, _ in chunks]))
        curve.committed(chunks[hits[1.0] :])  # what the store at 1x saved: what it missed
    snap = curve.snapshot()
    rows = [
        (f"{scale:g}x", lru.hit_rate, point["hit_rate"])
        for point, (scale, lru) in zip(snap["curve"], exact.items(), strict=True)
    ]
    return snap, [*rows, ("ceiling", unbounded.hit_rate, snap["ceiling_hit_rate"])]


def accuracy(max_keys: int) -> None:
    snap, rows = compare(REQUESTS, CAPACITY, max_keys)
    print(
        f"max_keys {max_keys}: sampling rate {snap['sampling_rate']:.4f}, "
        f"{snap['sampled_lookups']} lookups sampled"
    )
    print(f"  {'capacity':>10} {'exact LRU':>10} {'curve':>8} {'error (pp)':>11}")
    for name, exact, estimate in rows:
        print(f"  {name:>10} {exact:>10.3f} {estimate:>8.3f} {100 * (estimate - exact):>+11.2f}")
    print(f"  worst error {max(abs(100 * (e - x)) for _, x, e in rows):.2f} pp")


def cost() -> None:
    """What sizing adds to a lookup (the keys hashed once, the curve and the working-set sketch fed)
    against the store's whole lookup of the same keys, which includes it."""
    from kvpool_sidecar.arena import Arena
    from kvpool_sidecar.miss_ratio import key_hashes
    from kvpool_sidecar.store import Store

    with tempfile.TemporaryDirectory() as d:
        store = Store(Arena(Path(d), 64 * 2**20))
        requests = list(trace(2000, seed=1))
        for chunks in requests[:1000]:  # warm: the curve's ghosts and the store hold some of them
            store.put(chunks[0][0], b"x" * 1024)
            store.curve.committed(chunks)
        keys = [[k for k, _ in chunks] for chunks in requests]
        per_key = sum(map(len, keys))

        def sizing(ks: list[str]) -> None:
            hashes = key_hashes(ks)
            store.curve.looked_up(hashes)
            store.working_set.looked_up(hashes)

        def timed(run: Callable[[list[str]], object]) -> float:
            start = time.perf_counter()
            for ks in keys:
                run(ks)
            return (time.perf_counter() - start) / per_key * 1e6

        lookups, extra = [], []
        for _ in range(REPEAT):  # alternating
            lookups.append(timed(store.lookup))
            extra.append(timed(sizing))
        base, add = Spread.of(lookups), Spread.of(extra)
        ratio = Spread.of([c / b for c, b in zip(extra, lookups, strict=True)])
        print(
            f"per key looked up ({REPEAT} alternating runs, median [min-max]): store.lookup "
            f"{base.median:.2f} us [{base.low:.2f}-{base.high:.2f}], of which sizing {add.median:.2f} us "
            f"[{add.low:.2f}-{add.high:.2f}]: {ratio.median:.2f} [{ratio.low:.2f}-{ratio.high:.2f}] "
            "of the lookup"
        )


def main() -> None:
    for max_keys in (4096, 1024):
        accuracy(max_keys)
    cost()
